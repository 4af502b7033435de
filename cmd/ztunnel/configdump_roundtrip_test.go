package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

// dumpSections is /config_dump's workloads, services and policies for store, as JSON.
func dumpSections(t *testing.T, store *state.Store) []byte {
	t.Helper()
	d := store.Dump().(*state.Dump)
	b, err := json.MarshalIndent(map[string]any{"workloads": d.Workloads, "services": d.Services, "policies": d.Policies}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// localFromDump turns /config_dump's workloads, services and policies (JSON) into a
// LOCAL_XDS_PATH file (YAML). The two shapes differ in one place: the dump lists a
// workload's services by name and their ports under each service's endpoints, the file
// gives each workload a map of its services' ports. The rest is the dump's own fields,
// port maps keyed by number.
func localFromDump(t *testing.T, dump []byte) []byte {
	t.Helper()
	var d struct {
		Workloads []map[string]any `json:"workloads"`
		Services  []map[string]any `json:"services"`
		Policies  []any            `json:"policies"`
	}
	if err := json.Unmarshal(dump, &d); err != nil {
		t.Fatal(err)
	}
	ports := map[string]map[string]any{} // workload uid → service → ports
	for _, s := range d.Services {
		eps, _ := s["endpoints"].(map[string]any)
		for _, ep := range eps {
			ep := ep.(map[string]any)
			uid := ep["workloadUid"].(string)
			if ports[uid] == nil {
				ports[uid] = map[string]any{}
			}
			ports[uid][ep["service"].(string)] = numbered(t, ep["port"])
		}
		delete(s, "endpoints")
		s["ports"] = numbered(t, s["ports"])
	}
	for _, w := range d.Workloads {
		uid, _ := w["uid"].(string)
		if _, ok := w["services"]; ok {
			w["services"] = ports[uid]
		}
	}
	out, err := yaml.Marshal(map[string]any{"workloads": d.Workloads, "services": d.Services, "policies": d.Policies})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// numbered is a JSON port map ({"80": 8080}) keyed by number, as the file takes it.
func numbered(t *testing.T, m any) map[int]any {
	t.Helper()
	out := map[int]any{}
	for k, v := range m.(map[string]any) {
		n, err := strconv.Atoi(k)
		if err != nil {
			t.Fatalf("port %q: %v", k, err)
		}
		out[n] = v
	}
	return out
}

// TestConfigDumpToLocalFile: what /config_dump shows of testdata/config_dump.yaml (every
// workload, service and policy shape), written back as a LOCAL_XDS_PATH file, loads into
// a store whose dump is the same: the dump drops nothing the file can say, and an operator
// can reproduce a node's view from its dump.
func TestConfigDumpToLocalFile(t *testing.T) {
	first := state.NewStore()
	if _, err := xds.LoadFile("testdata/config_dump.yaml", first); err != nil {
		t.Fatal(err)
	}
	dump := dumpSections(t, first)
	path := filepath.Join(t.TempDir(), "from-dump.yaml")
	if err := os.WriteFile(path, localFromDump(t, dump), 0o644); err != nil {
		t.Fatal(err)
	}
	second := state.NewStore()
	if _, err := xds.LoadFile(path, second); err != nil {
		b, _ := os.ReadFile(path)
		t.Fatalf("the dump as a local file: %v\n%s", err, b)
	}
	if again := dumpSections(t, second); !bytes.Equal(again, dump) {
		t.Errorf("the dump of the file made from the dump differs:\n%s\nwant\n%s", again, dump)
	}
}
