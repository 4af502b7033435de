package bench

import (
	"bytes"
	"slices"
	"strings"
	"testing"
)

// envMap turns KEY=VALUE lines into a map, failing on a key given twice.
func envMap(t *testing.T, env []string) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if _, dup := m[k]; dup {
			t.Errorf("%s set twice in %v", k, env)
		}
		m[k] = v
	}
	return m
}

// Both programs get the same facts (topology, CA, token, worker threads, no source
// spoofing), each in its own spelling of the CA address; only gozt is told which CA kind
// and to keep TLS in user space.
func TestProgramEnvSameFacts(t *testing.T) {
	ca := nodeCA{rootFile: "/ca/root.pem", tokenFile: "/ca/token"}
	gozt := envMap(t, program{bin: "gozt"}.dedicatedEnv("node-a", "default/client/client", "/w.yaml", ca, true))
	rs := envMap(t, program{rust: true, bin: "rs"}.dedicatedEnv("node-a", "default/client/client", "/w.yaml", ca, true))
	for _, k := range []string{"NODE_NAME", "XDS_ADDRESS", "LOCAL_XDS_PATH", "CA_ROOT_CA", "AUTH_TOKEN", "CLUSTER_ID", "TRUST_DOMAIN",
		"ZTUNNEL_WORKER_THREADS", "ENABLE_ORIG_SRC", "PROXY_MODE", "PROXY_WORKLOAD_INFO", "UNSTABLE_ENABLE_SOCKS5"} {
		if gozt[k] != rs[k] {
			t.Errorf("%s: gozt %q, rs %q; want the same", k, gozt[k], rs[k])
		}
	}
	if gozt["PROXY_MODE"] != "dedicated" || gozt["PROXY_WORKLOAD_INFO"] != "default/client/client" || gozt["UNSTABLE_ENABLE_SOCKS5"] != "true" {
		t.Errorf("gozt env %v", gozt)
	}
	if rs["CA_ADDRESS"] != "https://127.0.0.1:15012" || gozt["CA_ADDRESS"] != "127.0.0.1:15012" || gozt["CA_PROVIDER"] != "istio" {
		t.Errorf("CA address: gozt %q (%q), rs %q", gozt["CA_ADDRESS"], gozt["CA_PROVIDER"], rs["CA_ADDRESS"])
	}
	if _, ok := rs["CA_PROVIDER"]; ok {
		t.Errorf("rs env has gozt's CA_PROVIDER")
	}
	if w := gozt["ZTUNNEL_WORKER_THREADS"]; w == "" || w == "0" {
		t.Errorf("ZTUNNEL_WORKER_THREADS=%q; want a fixed count", w)
	}
	b := envMap(t, program{rust: true}.dedicatedEnv("node-b", "default/server/server", "/w.yaml", ca, false))
	if _, ok := b["UNSTABLE_ENABLE_SOCKS5"]; ok {
		t.Errorf("node B has SOCKS5 on: %v", b)
	}
	sh := envMap(t, program{rust: true}.sharedEnv("node-b", "/a.sock", "/w.yaml", ca, "1337"))
	if sh["PROXY_MODE"] != "shared" || sh["INPOD_UDS"] != "/a.sock" || sh["PACKET_MARK"] != "1337" || sh["NODE_NAME"] != "node-b" {
		t.Errorf("shared env %v", sh)
	}
}

// Without the Rust ztunnel's binary only gozt's namespace pair is there (the suite leaves
// even that out); with it, the Rust pair and both mixed pairs, each with distinct tags.
func TestNsPairs(t *testing.T) {
	gozt, rs := program{bin: "g"}, program{rust: true, bin: "r"}
	if ps := nsPairs(gozt, program{rust: true}); len(ps) != 1 || ps[0].name != "ztunnel-ns" {
		t.Errorf("pairs without rs: %+v", ps)
	}
	var names, tags []string
	for _, p := range nsPairs(gozt, rs) {
		names, tags = append(names, p.name), append(tags, p.tag)
	}
	if want := []string{"ztunnel-ns", "ztunnel-rs", "gozt→rs", "rs→gozt"}; !slices.Equal(names, want) {
		t.Errorf("pairs %v; want %v", names, want)
	}
	slices.Sort(tags)
	if len(slices.Compact(tags)) != 4 {
		t.Errorf("tags %v not distinct", tags)
	}
	ps := nsPairs(gozt, rs)
	if ps[2].a.rust || !ps[2].b.rust || !ps[3].a.rust || ps[3].b.rust {
		t.Errorf("mixed pairs: %+v", ps[2:])
	}
	// Namespaces, veths: distinct per program and pair, veth names within IFNAMSIZ.
	for _, pg := range []program{gozt, rs} {
		a, b := vethNames("rg", pg)
		if len(a) > 15 || len(b) > 15 || a == b {
			t.Errorf("veth names %q %q", a, b)
		}
	}
	if slices.Equal(captureNamespaces(gozt), captureNamespaces(rs)) {
		t.Errorf("capture namespaces the same for both programs")
	}
}

// The "× ztunnel-rs" line: each gozt path's figure over its Rust counterpart's.
func TestReportRustRatios(t *testing.T) {
	rep := &Report{
		Paths: []string{"veth", "capture", "capture-rs", "ztunnel-ns", "ztunnel-rs"},
		Rust:  map[string]string{"capture": "capture-rs", "ztunnel-ns": "ztunnel-rs"},
	}
	for p, g := range map[string]float64{"veth": 20, "capture": 3, "capture-rs": 2, "ztunnel-ns": 6, "ztunnel-rs": 4} {
		rep.Runs = append(rep.Runs, &Result{Case: "throughput/1", Path: p, Rep: 1, Elapsed: 1e9, Bytes: int64(g * 1e9 / 8)})
	}
	rows := rep.Table()
	if len(rows) == 0 {
		t.Fatal("no rows")
	}
	got := rows[0].RustRatios
	if got["capture"] != 1.5 || got["ztunnel-ns"] != 1.5 || len(got) != 2 {
		t.Errorf("rust ratios %v; want capture and ztunnel-ns 1.5", got)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	var line string
	for l := range strings.SplitSeq(table.String(), "\n") {
		if strings.Contains(l, "× ztunnel-rs") && !strings.Contains(l, "figure") {
			line = l
		}
	}
	if strings.Count(line, "1.50") != 2 {
		t.Errorf("× ztunnel-rs line %q; want 1.50 under capture and ztunnel-ns\n%s", line, table.String())
	}
}

// The local workload file names both workloads with services and trust domain spelled out
// (the Rust ztunnel needs both) and nothing else differs between the two.
func TestLocalWorkloads(t *testing.T) {
	y := localWorkloads("10.0.0.1", "10.0.0.2")
	for _, want := range []string{
		"uid: Kubernetes//v1/Pod/default/client", `workloadIps: ["10.0.0.1"]`, "node: node-a",
		"uid: Kubernetes//v1/Pod/default/server", `workloadIps: ["10.0.0.2"]`, "node: node-b",
	} {
		if !strings.Contains(y, want) {
			t.Errorf("workloads lack %q:\n%s", want, y)
		}
	}
	if strings.Count(y, "services: {}") != 2 || strings.Count(y, "trustDomain: cluster.local") != 2 {
		t.Errorf("services or trust domain missing:\n%s", y)
	}
}
