package state

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestDumpJSON(t *testing.T) {
	s := NewStore()
	s.Apply(&Batch{
		Workloads: []*Workload{wl("b", "10.0.0.2", inSvc(echoKey, map[uint16]uint16{80: 8080})), wl("a", "10.0.0.1")},
		Services:  []*Service{echo()},
		Policies: []*Policy{{Name: "p", Namespace: "default", Scope: ScopeNamespace, Action: ActionDeny, Rules: []Rule{{Clauses: []Clause{{Matches: []Match{{
			NotPrincipals: []StringMatch{{Kind: MatchPresence}}, DestinationPorts: []uint16{80},
		}}}}}}}},
	})
	b, err := json.Marshal(s.Dump())
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Workloads []map[string]any `json:"workloads"`
		Services  []map[string]any `json:"services"`
		Policies  []map[string]any `json:"policies"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Workloads) != 2 || d.Workloads[0]["name"] != "a" || d.Workloads[1]["protocol"] != "HBONE" {
		t.Errorf("workloads not sorted by uid or misnamed: %v", d.Workloads)
	}
	for _, key := range []string{"uid", "workloadIps", "trustDomain", "serviceAccount", "status", "clusterId", "capacity", "services"} {
		if _, ok := d.Workloads[1][key]; !ok {
			t.Errorf("workload lacks %q: %v", key, d.Workloads[1])
		}
	}
	// Empty ones are left out, as the Rust ztunnel leaves them out (interop's observability test).
	for _, key := range []string{"canonicalName", "authorizationPolicies", "hostname", "network"} {
		if v, ok := d.Workloads[1][key]; ok {
			t.Errorf("workload has empty %q = %v; want it left out", key, v)
		}
	}
	svc := d.Services[0]
	eps, _ := svc["endpoints"].(map[string]any)
	ep, _ := eps["Kubernetes//v1/Pod/default/b"].(map[string]any)
	if svc["hostname"] != "echo.default.svc" || ep["workloadUid"] != "Kubernetes//v1/Pod/default/b" || ep["status"] != "Healthy" {
		t.Errorf("service = %v", svc)
	}
	if vips, _ := svc["vips"].([]any); len(vips) != 1 || vips[0] != "/10.96.0.10" {
		t.Errorf("vips = %v", svc["vips"])
	}
	js := string(b)
	for _, frag := range []string{`"action":"Deny"`, `"scope":"Namespace"`, `"notPrincipals":[{"Presence":[]}]`, `"destinationPorts":[80]`, `"ports":{"80":8080}`} {
		if !strings.Contains(js, frag) {
			t.Errorf("dump lacks %s: %s", frag, js)
		}
	}
}
