//go:build linux

package interop

import (
	"slices"
	"testing"
)

// The comparisons run without the Rust ztunnel, on made-up input, so that CI checks them.

func TestParseMetricsBothFormats(t *testing.T) {
	prom := `# HELP istio_tcp_connections_opened_total x
# TYPE istio_tcp_connections_opened_total counter
istio_tcp_connections_opened_total{reporter="source",destination_service="a \"b\", c"} 1
workload_manager_active_proxy_count 2
go_goroutines 9
`
	open := `# TYPE istio_tcp_connections_opened counter
istio_tcp_connections_opened_total{reporter="source",source_zone="z"} 1
# EOF
`
	p, o := parseMetrics(prom), parseMetrics(open)
	if f := p["istio_tcp_connections_opened_total"]; f == nil || f.typ != "counter" || !f.labels["destination_service"] {
		t.Errorf("Prometheus text: %+v", f)
	}
	if f := p["workload_manager_active_proxy_count"]; f == nil || f.typ != "untyped" {
		t.Errorf("untyped sample: %+v", f)
	}
	if p["go_goroutines"] != nil {
		t.Error("go_goroutines is not compared")
	}
	if f := o["istio_tcp_connections_opened_total"]; f == nil || f.typ != "counter" {
		t.Errorf("OpenMetrics family without _total: %+v", f)
	}
	d := compareMetrics("node", prom, open)
	want := []string{
		"node: metric istio_tcp_connections_opened_total labels only in gozt: destination_service",
		"node: metric istio_tcp_connections_opened_total labels only in rs: source_zone",
		"node: metric workload_manager_active_proxy_count only in gozt",
	}
	if !slices.Equal(d, want) {
		t.Errorf("compareMetrics:\n got %q\nwant %q", d, want)
	}
	_, lbls := splitSample(`x{a="1",b="q\"uote"} 3`)
	if lbls["a"] != "1" || lbls["b"] != `q"uote` {
		t.Errorf("labels %v", lbls)
	}
}

func TestCompareDumpSections(t *testing.T) {
	g := `{"config":{"A":1},"workloads":[{"uid":"u","name":"n"}],"kernelTls":{"enabled":true,"x":{"y":1}}}`
	r := `{"config":{"b":2},"workloads":[{"uid":"u","name":"n","extra":""}],"staticConfig":{"a":[1]}}`
	got := compareDump("node", g, r)
	want := []string{
		"node: /config_dump keys only in gozt: .kernelTls",
		"node: /config_dump keys only in rs: .staticConfig .workloads[].extra",
	}
	if !slices.Equal(got, want) {
		t.Errorf("compareDump:\n got %q\nwant %q", got, want)
	}
}

func TestCompareObserved(t *testing.T) {
	obs := observed{}
	for _, p := range pairs {
		obs.add("same", pairName(p), "ok")
		obs.add("differs", pairName(p), map[bool]string{true: "a", false: "b"}[p[0] == gozt])
	}
	got := compareObserved(obs)
	want := []string{"differs: gozt-gozt=a, gozt-rs=a, rs-gozt=b, rs-rs=b"}
	if !slices.Equal(got, want) {
		t.Errorf("compareObserved = %q, want %q", got, want)
	}
}

// The checked-in list parses, and every entry says why.
func TestKnownDifferencesHaveReasons(t *testing.T) {
	if known := knownDifferences(t); len(known) == 0 {
		t.Error("testdata/differences.txt lists nothing")
	}
}
