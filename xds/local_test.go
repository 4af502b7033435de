package xds

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/xds/state"
)

func TestExamplesLoad(t *testing.T) {
	t.Run("localhost", func(t *testing.T) {
		s := state.NewStore()
		if _, err := LoadFile("../examples/localhost.yaml", s); err != nil {
			t.Fatal(err)
		}
		w := s.FindWorkload("default", "local")
		if w == nil || w.Node != "local" || w.Protocol != state.TunnelHBONE ||
			w.Identity().String() != "spiffe://cluster.local/ns/default/sa/default" || !w.HasAddress(netip.MustParseAddr("127.0.0.1")) {
			t.Fatalf("local workload = %+v", w)
		}
		r, err := s.Resolve(w, netip.MustParseAddrPort("127.10.0.1:80"))
		if err != nil {
			t.Fatal(err)
		}
		if r.Kind != state.RouteHBONE || r.Dial.String() != "127.0.0.1:15008" || r.Authority != "127.0.0.1:8080" || r.Service.Hostname != "echo.default.svc.cluster.local" {
			t.Errorf("route to echo = %+v", r)
		}
	})
	t.Run("two-nodes", func(t *testing.T) {
		s := state.NewStore()
		if _, err := LoadFile("../examples/two-nodes.yaml", s); err != nil {
			t.Fatal(err)
		}
		client, server := s.FindWorkload("default", "client"), s.FindWorkload("default", "server")
		if client == nil || server == nil || client.Node != "node-a" || server.Node != "node-b" ||
			client.Identity().ServiceAccount() != "client" || server.Identity().ServiceAccount() != "server" {
			t.Fatalf("workloads: client %+v server %+v", client, server)
		}
		r, err := s.Resolve(client, netip.MustParseAddrPort("127.10.0.1:80"))
		if err != nil {
			t.Fatal(err)
		}
		if r.Workload != server || r.Dial.String() != "127.0.0.3:15008" || r.Authority != "127.0.0.3:8080" {
			t.Errorf("route = %+v", r)
		}
	})
}

const fullLocal = `
workloads:
  - name: wp
    namespace: default
    workloadIps: ["10.0.0.100"]
    protocol: HBONE
  - uid: u-app
    name: app
    namespace: default
    serviceAccount: app
    trustDomain: td.example
    workloadIps: ["10.0.0.1", "fd00::1"]
    protocol: TCP
    node: n1
    network: ""
    status: Unhealthy
    capacity: 4
    clusterId: c1
    locality: {region: r1, zone: z1}
    workloadType: pod
    waypoint: {destination: "/10.0.0.100", hboneMtlsPort: 15009}
    applicationTunnel: {protocol: PROXY, port: 15088}
    authorizationPolicies: [default/sel]
    services:
      "default/app.default.svc": {80: 8080}
services:
  - name: app
    namespace: default
    hostname: app.default.svc
    vips: ["/10.96.0.1", "/10.100.0.0/16"]
    ports: {80: 8080}
    subjectAltNames: ["spiffe://td.example/ns/default/sa/app"]
    loadBalancer: {routingPreferences: [Region, Zone], mode: Failover, healthPolicy: AllowAll}
    visibility: Namespace
    canonical: true
policies:
  - name: sel
    namespace: default
    scope: WorkloadSelector
    action: Deny
    dryRun: true
    rules:
      - - - namespaces: [{Exact: default}]
            notPrincipals: [Presence]
            principals: [{Prefix: "td.example/"}]
            sourceIps: ["10.0.0.0/8", "10.1.2.3"]
            destinationPorts: [8080]
            serviceAccounts: [{namespace: default, serviceAccount: app}]
`

func TestLocalFullShape(t *testing.T) {
	b, err := ParseFile("full.yaml", []byte(fullLocal))
	if err != nil {
		t.Fatal(err)
	}
	s := state.NewStore()
	s.Apply(b)
	w := s.WorkloadByUID("u-app")
	if w == nil {
		t.Fatal("app not loaded")
	}
	if w.Protocol != state.TunnelNone || w.Healthy || w.Capacity != 4 || w.ClusterID != "c1" || w.Locality.Zone != "z1" ||
		w.Waypoint.Port() != 15009 || w.AppTunnel.Protocol != state.AppTunnelProxy || w.WorkloadType != state.WorkloadPod ||
		w.Identity().String() != "spiffe://td.example/ns/default/sa/app" || len(w.Addresses) != 2 {
		t.Errorf("workload = %+v", w)
	}
	if s.FindWorkload("default", "wp").UID != "Kubernetes//v1/Pod/default/wp" {
		t.Error("default uid not derived from name")
	}
	svc := s.ServiceByVIP("", netip.MustParseAddr("10.100.3.4"), "default")
	if svc == nil || !svc.Canonical || svc.Visibility != state.VisibilityNamespace || svc.LoadBalancing.Mode != state.LBFailover ||
		svc.LoadBalancing.HealthPolicy != state.AllowAll || len(svc.LoadBalancing.RoutingPreference) != 2 {
		t.Errorf("service via CIDR vip = %+v", svc)
	}
	pols := s.PoliciesFor(w)
	if len(pols) != 1 || pols[0].Action != state.ActionDeny || !pols[0].DryRun {
		t.Fatalf("policies = %+v", pols)
	}
	m := pols[0].Rules[0].Clauses[0].Matches[0]
	if m.NotPrincipals[0].Kind != state.MatchPresence || m.Principals[0].Kind != state.MatchPrefix || m.SourceIPs[1] != netip.MustParsePrefix("10.1.2.3/32") ||
		m.DestinationPorts[0] != 8080 || m.ServiceAccounts[0].ServiceAccount != "app" {
		t.Errorf("match = %+v", m)
	}
}

// A presence match is the bare Presence or the Rust ztunnel's form, {Presence: []} (what
// istioctl prints back from /config_dump); {Presence: {}} is taken too.
func TestLocalPresenceForms(t *testing.T) {
	for _, form := range []string{"Presence", "{Presence: []}", "{Presence: {}}"} {
		b, err := ParseFile("p.yaml", []byte("policies:\n  - name: p\n    rules: [[[ {notPrincipals: ["+form+"]} ]]]\n"))
		if err != nil {
			t.Errorf("%s: %v", form, err)
			continue
		}
		if m := b.Policies[0].Rules[0].Clauses[0].Matches[0]; len(m.NotPrincipals) != 1 || m.NotPrincipals[0].Kind != state.MatchPresence {
			t.Errorf("%s: match = %+v; want one presence", form, m)
		}
	}
}

// The Rust ztunnel's serde_yaml reads its StringMatch enum only as a YAML tag; its files
// write matches that way, and gozt reads them alike.
func TestLocalTaggedStringMatches(t *testing.T) {
	b, err := ParseFile("p.yaml", []byte(`policies:
  - name: p
    rules:
      - - - principals: [!Exact cluster.local/ns/a/sa/b, !Prefix "cluster.local/ns/c/"]
            namespaces: [!Suffix -prod]
            notPrincipals: [!Presence []]
`))
	if err != nil {
		t.Fatal(err)
	}
	m := b.Policies[0].Rules[0].Clauses[0].Matches[0]
	if len(m.Principals) != 2 || m.Principals[0].Kind != state.MatchExact || m.Principals[0].Value != "cluster.local/ns/a/sa/b" ||
		m.Principals[1].Kind != state.MatchPrefix || m.Principals[1].Value != "cluster.local/ns/c/" ||
		len(m.Namespaces) != 1 || m.Namespaces[0].Kind != state.MatchSuffix || m.Namespaces[0].Value != "-prod" ||
		len(m.NotPrincipals) != 1 || m.NotPrincipals[0].Kind != state.MatchPresence {
		t.Fatalf("match = %+v", m)
	}
	if _, err := ParseFile("p.yaml", []byte("policies:\n  - name: p\n    rules: [[[ {principals: [!Regex x]} ]]]\n")); err == nil || !strings.Contains(err.Error(), `unknown string match "Regex"`) {
		t.Errorf("!Regex: %v; want an unknown string match error", err)
	}
}

func TestLocalErrors(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"unknown field", "workloads:\n  - name: a\n    colour: blue\n", "xds: bad.yaml: line 3: field colour not found in type"},
		{"bad ip", "workloads:\n  - name: a\n    workloadIps: [\"10.0.0.1\",\n      \"10.0.0.x\"]\n", `line 4: workloads[0].workloadIps[1]: invalid IP "10.0.0.x"`},
		{"bad protocol", "workloads:\n  - name: a\n\n    protocol: QUIC\n", `line 4: workloads[0].protocol: unknown protocol "QUIC"`},
		{"bad vip", "services:\n  - hostname: h\n    vips: [\"nope\"]\n", `line 3: services[0].vips[0]: invalid address "nope"`},
		{"missing hostname", "services:\n  - name: h\n    namespace: n\n", `line 2: services[0]: service "n/": hostname: empty`},
		{"bad string match", "policies:\n  - name: p\n    rules: [[[ {namespaces: [{Regex: x}]} ]]]\n", `line 3: unknown string match "Regex"`},
		{"presence with a value", "policies:\n  - name: p\n    rules: [[[ {principals: [{Presence: [x]}]} ]]]\n", `line 3: Presence takes no value`},
		{"exact with a list", "policies:\n  - name: p\n    rules: [[[ {principals: [{Exact: [x]}]} ]]]\n", `line 3: Exact takes a string`},
		{"bad policy cidr", "policies:\n  - name: p\n    rules:\n      - - - sourceIps: [10.0.0.0/99]\n", `line 4: policies[0].rules[0][0][0].sourceIps[0]: invalid CIDR`},
		{"bad type", "workloads:\n  - name: a\n    capacity: lots\n", "line 3: cannot unmarshal"},
		{"bad gateway", "workloads:\n  - name: a\n    waypoint: {destination: nowhere}\n", `line 3: workloads[0].waypoint: destination "nowhere"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseFile("bad.yaml", []byte(tc.yaml))
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "xds: bad.yaml: ") {
				t.Fatalf("err = %v; want containing %q", err, tc.want)
			}
		})
	}
	if b, err := ParseFile("empty.yaml", nil); err != nil || !b.Empty() {
		t.Errorf("empty file: %v %+v", err, b)
	}
	if _, err := LoadFile(filepath.Join(t.TempDir(), "missing.yaml"), state.NewStore()); err == nil {
		t.Error("missing file accepted")
	}
}

func TestLocalReload(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "cfg.yaml")
		write := func(s string) {
			if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		const two = "workloads:\n  - {uid: a, name: a, namespace: d, workloadIps: [10.0.0.1]}\n  - {uid: b, name: b, namespace: d, workloadIps: [10.0.0.2]}\n"
		write(two)
		s := state.NewStore()
		// A resource from another source (xDS) must survive local reloads.
		s.Apply(&state.Batch{Workloads: []*state.Workload{{UID: "from-xds", Name: "x", WorkloadMeta: &state.WorkloadMeta{Namespace: "d"}}}})
		l, err := LoadFile(path, s)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error)
		go func() { done <- l.Run(ctx) }()
		changes := s.Subscribe(ctx)

		write("workloads:\n  - {uid: a, name: a, namespace: d, workloadIps: [10.0.0.9]}\n")
		time.Sleep(1500 * time.Millisecond) // fake time: one poll
		synctest.Wait()
		<-changes
		if s.WorkloadByUID("b") != nil || s.WorkloadByIP("", netip.MustParseAddr("10.0.0.9")) == nil || s.WorkloadByUID("from-xds") == nil {
			t.Fatalf("reload not applied: %+v", s.Dump())
		}
		write("workloads: [ {uid: a, workloadIps: [not-an-ip]} ]\n") // bad: state kept
		time.Sleep(1500 * time.Millisecond)
		synctest.Wait()
		select {
		case <-changes:
			t.Fatal("bad file changed the state")
		default:
		}
		if s.WorkloadByIP("", netip.MustParseAddr("10.0.0.9")) == nil {
			t.Fatal("bad file dropped the previous state")
		}
		write(two) // recovers
		time.Sleep(1500 * time.Millisecond)
		synctest.Wait()
		if s.WorkloadByUID("b") == nil {
			t.Fatal("good file after a bad one not loaded")
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
}
