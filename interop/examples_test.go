//go:build linux

package interop

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestExamples starts each program on every local config file gozt's docs show
// (examples/*.yaml) and, when ZTUNNEL_RS_SRC names a checkout of the Rust ztunnel's source,
// on its examples/localhost.yaml too: each must come up ready serving the file's first
// workload, with every workload of the file in its /config_dump.
func TestExamples(t *testing.T) {
	requirePeers(t)
	files, err := filepath.Glob("../examples/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	if src := os.Getenv("ZTUNNEL_RS_SRC"); src != "" {
		files = append(files, filepath.Join(src, "examples", "localhost.yaml"))
	} else {
		t.Log("ZTUNNEL_RS_SRC is not set: the Rust ztunnel's own examples/localhost.yaml is not tried")
	}
	for _, file := range files {
		var cfg struct {
			Workloads []struct {
				UID            string `yaml:"uid"`
				Name           string `yaml:"name"`
				Namespace      string `yaml:"namespace"`
				ServiceAccount string `yaml:"serviceAccount"`
			} `yaml:"workloads"`
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, &cfg); err != nil || len(cfg.Workloads) == 0 {
			t.Fatalf("%s: %v (%d workloads)", file, err, len(cfg.Workloads))
		}
		first := cfg.Workloads[0]
		var want []string
		for _, w := range cfg.Workloads {
			want = append(want, w.UID)
		}
		slices.Sort(want)
		for _, prog := range []string{gozt, rs} {
			name := "gozt/" + filepath.Base(file)
			if !strings.HasPrefix(file, "../") {
				name = "ztunnel-rs/" + filepath.Base(file)
			}
			t.Run(name+"/"+prog, func(t *testing.T) {
				h := newHost(t, "ex")
				c := newCA(t)
				c.serveIn(t, h)
				env := c.env(prog)
				for k, v := range map[string]string{
					"PROXY_MODE":          "dedicated",
					"PROXY_WORKLOAD_INFO": first.Namespace + "/" + first.Name + "/" + first.ServiceAccount,
					"XDS_ADDRESS":         "",
					"LOCAL_XDS_PATH":      file,
				} {
					env[k] = v
				}
				if abs, err := filepath.Abs(file); err == nil {
					env["LOCAL_XDS_PATH"] = abs
				}
				n := startNode(t, prog, h, env)
				code, body, err := n.get("15000", "/config_dump")
				if err != nil || code != 200 {
					t.Fatalf("/config_dump: %d %v", code, err)
				}
				var dump struct {
					Workloads []struct{ UID string } `json:"workloads"`
				}
				if err := json.Unmarshal([]byte(body), &dump); err != nil {
					t.Fatal(err)
				}
				var got []string
				for _, w := range dump.Workloads {
					got = append(got, w.UID)
				}
				slices.Sort(got)
				if !slices.Equal(got, want) {
					t.Errorf("workloads in /config_dump %v; the file has %v", got, want)
				}
			})
		}
	}
}
