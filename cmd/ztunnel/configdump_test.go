package main

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"math/big"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

var update = flag.Bool("update", false, "rewrite testdata/config_dump.golden.json")

// What istioctl ztunnel-config decodes /config_dump into: the types of istio.io/istio
// istioctl/pkg/writer/ztunnel/configdump (api.go), same field names, tags and Go types,
// less WorkloadState (shared mode only). Every view (workloads, services, policies,
// certificates) reads the whole dump, so one section it cannot decode breaks them all.
type (
	ZtunnelDump struct {
		Workloads    []*ZtunnelWorkload `json:"workloads"`
		Services     []*ZtunnelService  `json:"services"`
		Policies     []*ZtunnelPolicy   `json:"policies"`
		Certificates []*CertsDump       `json:"certificates"`
	}
	Locality struct {
		Region  string `json:"region,omitempty"`
		Zone    string `json:"zone,omitempty"`
		Subzone string `json:"subzone,omitempty"`
	}
	ZtunnelWorkload struct {
		UID                   string            `json:"uid"`
		WorkloadIPs           []string          `json:"workloadIps"`
		Waypoint              *GatewayAddress   `json:"waypoint,omitempty"`
		NetworkGateway        *GatewayAddress   `json:"networkGateway,omitempty"`
		Protocol              string            `json:"protocol"`
		Name                  string            `json:"name"`
		Namespace             string            `json:"namespace"`
		ServiceAccount        string            `json:"serviceAccount"`
		WorkloadName          string            `json:"workloadName"`
		WorkloadType          string            `json:"workloadType"`
		CanonicalName         string            `json:"canonicalName"`
		CanonicalRevision     string            `json:"canonicalRevision"`
		ClusterID             string            `json:"clusterId"`
		TrustDomain           string            `json:"trustDomain,omitempty"`
		Locality              Locality          `json:"locality,omitempty"`
		Node                  string            `json:"node"`
		Network               string            `json:"network,omitempty"`
		Status                string            `json:"status"`
		Hostname              string            `json:"hostname"`
		Capacity              uint32            `json:"capacity"`
		ApplicationTunnel     ApplicationTunnel `json:"applicationTunnel,omitempty"`
		AuthorizationPolicies []string          `json:"authorizationPolicies,omitempty"`
	}
	ApplicationTunnel struct {
		Protocol string  `json:"protocol"`
		Port     *uint16 `json:"port,omitempty"`
	}
	GatewayAddress struct {
		Destination string `json:"destination"`
	}
	LoadBalancer struct {
		Mode               string   `json:"mode"`
		RoutingPreferences []string `json:"routingPreferences"`
		HealthPolicy       string   `json:"healthPolicy"`
	}
	ZtunnelEndpoint struct {
		WorkloadUID string            `json:"workloadUid"`
		Service     string            `json:"service"`
		Address     string            `json:"address,omitempty"`
		Port        map[uint16]uint16 `json:"port"`
	}
	ZtunnelService struct {
		Name            string                      `json:"name"`
		Namespace       string                      `json:"namespace"`
		Hostname        string                      `json:"hostname"`
		Addresses       []string                    `json:"vips"`
		Ports           map[string]int              `json:"ports"`
		LoadBalancer    *LoadBalancer               `json:"loadBalancer,omitempty"`
		Waypoint        *GatewayAddress             `json:"waypoint,omitempty"`
		Endpoints       map[string]*ZtunnelEndpoint `json:"endpoints"`
		SubjectAltNames []string                    `json:"subjectAltNames,omitempty"`
		IPFamilies      string                      `json:"ipFamilies"`
	}
	PolicyMatch struct {
		Namespaces          []StringMatch         `json:"namespaces,omitempty"`
		NotNamespaces       []StringMatch         `json:"notNamespaces,omitempty"`
		Principals          []StringMatch         `json:"principals,omitempty"`
		NotPrincipals       []StringMatch         `json:"notPrincipals,omitempty"`
		SourceIps           []string              `json:"sourceIps,omitempty"`
		NotSourceIps        []string              `json:"notSourceIps,omitempty"`
		DestinationIps      []string              `json:"destinationIps,omitempty"`
		NotDestinationIps   []string              `json:"notDestinationIps,omitempty"`
		DestinationPorts    []uint16              `json:"destinationPorts,omitempty"`
		NotDestinationPorts []uint16              `json:"notDestinationPorts,omitempty"`
		ServiceAccounts     []ServiceAccountMatch `json:"serviceAccounts,omitempty"`
		NotServiceAccounts  []ServiceAccountMatch `json:"notServiceAccounts,omitempty"`
	}
	StringMatch struct {
		Exact    string `json:"Exact,omitempty"`
		Suffix   string `json:"Suffix,omitempty"`
		Prefix   string `json:"Prefix,omitempty"`
		Presence any    `json:"Presence,omitempty"`
	}
	ServiceAccountMatch struct {
		Namespace      string `json:"namespace"`
		ServiceAccount string `json:"serviceAccount"`
	}
	ZtunnelPolicy struct {
		Name      string             `json:"name"`
		Namespace string             `json:"namespace"`
		Scope     string             `json:"scope"`
		Action    string             `json:"action"`
		Rules     [][][]*PolicyMatch `json:"rules"`
	}
	CertsDump struct {
		Identity  string  `json:"identity"`
		State     string  `json:"state"`
		CertChain []*Cert `json:"certChain"`
		RootCert  []*Cert `json:"rootCerts"`
	}
	Cert struct {
		Pem            string `json:"pem"`
		SerialNumber   string `json:"serialNumber"`
		ValidFrom      string `json:"validFrom"`
		ExpirationTime string `json:"expirationTime"`
	}
)

// primeIstioctl decodes a dump as istioctl's ConfigWriter.Prime does (the whole dump, then
// each section with encoding/json), and more strictly where istioctl's types name every
// field we write: policy rules and certificates must hold no field istioctl does not know.
func primeIstioctl(b []byte) (*ZtunnelDump, error) {
	var raw struct{ Workloads, Services, Policies, Certificates json.RawMessage }
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil, err
	}
	d := &ZtunnelDump{}
	for _, s := range []struct {
		raw json.RawMessage
		v   any
	}{{raw.Workloads, &d.Workloads}, {raw.Services, &d.Services}, {raw.Policies, &d.Policies}} {
		if err := json.Unmarshal(s.raw, s.v); err != nil {
			return nil, err
		}
	}
	if err := strictJSON(raw.Certificates, &d.Certificates); err != nil {
		return nil, fmt.Errorf("certificates: %w", err)
	}
	var rules []struct{ Rules json.RawMessage }
	if err := json.Unmarshal(raw.Policies, &rules); err != nil {
		return nil, err
	}
	for i, r := range rules {
		var m [][][]*PolicyMatch
		if err := strictJSON(r.Rules, &m); err != nil {
			return nil, fmt.Errorf("policy %d rules: %w", i, err)
		}
	}
	return d, nil
}

func strictJSON(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

// fixedCA issues one certificate, the same every time: ed25519 signatures are deterministic,
// so the dump's PEM, serial and dates are stable. Any other identity fails.
type fixedCA struct{ iss *ca.Issued }

func (f fixedCA) Fetch(_ context.Context, id identity.ID) (*ca.Issued, error) {
	if got, _ := f.iss.Identity(); got == id {
		return f.iss, nil
	}
	return nil, errors.New("fixed ca: no certificate for " + id.String())
}

func (fixedCA) Close() error { return nil }

func newFixedCA(t *testing.T, id identity.ID) fixedCA {
	t.Helper()
	from, until := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC)
	rootKey, leafKey := ed25519.NewKeyFromSeed(bytes.Repeat([]byte{1}, 32)), ed25519.NewKeyFromSeed(bytes.Repeat([]byte{2}, 32))
	rootTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "config dump test root"}, SubjectKeyId: []byte{1},
		NotBefore: from, NotAfter: until, IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	u, _ := url.Parse(id.String())
	leafTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(0x0123456789abcdef), URIs: []*url.URL{u}, SubjectKeyId: []byte{2},
		NotBefore: from, NotAfter: until, KeyUsage: x509.KeyUsageDigitalSignature,
	}
	rootDER, err := x509.CreateCertificate(rand.Reader, rootTmpl, rootTmpl, rootKey.Public(), rootKey)
	if err != nil {
		t.Fatal(err)
	}
	root, err := x509.ParseCertificate(rootDER)
	if err != nil {
		t.Fatal(err)
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, root, leafKey.Public(), rootKey)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(leafDER)
	if err != nil {
		t.Fatal(err)
	}
	return fixedCA{&ca.Issued{
		Certificate: tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: leafKey, Leaf: leaf},
		Roots:       []*x509.Certificate{root}, NotBefore: from, NotAfter: until,
	}}
}

// TestConfigDumpIstioctl serves /config_dump for testdata/config_dump.yaml (every workload,
// service and policy shape, every string match kind in every match field) and a certificate
// in each state, compares it with testdata/config_dump.golden.json, and reads it the way
// istioctl ztunnel-config does: a shape istioctl cannot read fails here first.
func TestConfigDumpIstioctl(t *testing.T) {
	leaktest.Check(t)
	store := state.NewStore()
	if _, err := xds.LoadFile("testdata/config_dump.yaml", store); err != nil {
		t.Fatal(err)
	}
	app, broken := identity.MustParse("spiffe://cluster.local/ns/default/sa/app"), identity.MustParse("spiffe://cluster.local/ns/default/sa/broken")
	m := certs.New(certs.Config{}, newFixedCA(t, app))
	t.Cleanup(func() { m.Close() })
	if _, err := m.Certificate(context.Background(), app); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Certificate(context.Background(), broken); err == nil {
		t.Fatal("fixed ca issued for an identity it does not have")
	}
	n := &ztunnel{cfg: &config{}, store: store, certs: m}
	rec := httptest.NewRecorder()
	adminHandler(mustLogLevels(t), n.configDump, func() {}).ServeHTTP(rec, httptest.NewRequest("GET", "/config_dump", nil))
	body := rec.Body.Bytes()

	// The golden file holds the sections istioctl reads; version and config vary by build.
	var sections map[string]json.RawMessage
	if err := json.Unmarshal(body, &sections); err != nil {
		t.Fatal(err)
	}
	for k := range sections {
		if k == "version" || k == "config" {
			delete(sections, k)
		}
	}
	got, err := json.MarshalIndent(sections, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	const golden = "testdata/config_dump.golden.json"
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if want, err := os.ReadFile(golden); err != nil || !bytes.Equal(got, want) {
		t.Errorf("/config_dump differs from %s (go test ./cmd/ztunnel -run TestConfigDumpIstioctl -update rewrites it; check the diff): %v\n%s", golden, err, got)
	}

	d, err := primeIstioctl(body)
	if err != nil {
		t.Fatalf("istioctl cannot read /config_dump: %v", err)
	}
	if len(d.Workloads) != 2 || len(d.Services) != 2 || len(d.Policies) != 4 || len(d.Certificates) != 2 {
		t.Fatalf("istioctl reads %d workloads, %d services, %d policies, %d certificates; want 2, 2, 4, 2",
			len(d.Workloads), len(d.Services), len(d.Policies), len(d.Certificates))
	}
	// Every string match holds exactly one kind; a presence one (six in the file) a non-nil
	// Presence, which is how istioctl tells it from an empty match.
	presences := 0
	for _, p := range d.Policies {
		for _, r := range p.Rules {
			for _, c := range r {
				for _, pm := range c {
					for _, ms := range [][]StringMatch{pm.Namespaces, pm.NotNamespaces, pm.Principals, pm.NotPrincipals} {
						for _, sm := range ms {
							kinds := 0
							for _, set := range []bool{sm.Exact != "", sm.Prefix != "", sm.Suffix != "", sm.Presence != nil} {
								if set {
									kinds++
								}
							}
							if kinds != 1 {
								t.Errorf("policy %s/%s: string match %+v has %d kinds; want 1", p.Namespace, p.Name, sm, kinds)
							}
							if sm.Presence != nil {
								presences++
							}
						}
					}
				}
			}
		}
	}
	if presences != 6 {
		t.Errorf("istioctl reads %d presence matches; want 6", presences)
	}
	w, svc, pol, cert := d.Workloads[0], d.Services[0], d.Policies[0], d.Certificates[0]
	var chain Cert
	if len(cert.CertChain) == 1 && len(cert.RootCert) == 1 {
		chain = *cert.CertChain[0]
	}
	pemText, _ := base64.StdEncoding.DecodeString(chain.Pem)
	block, _ := pem.Decode(pemText)
	serial, _ := new(big.Int).SetString(chain.SerialNumber, 10)
	expires, _ := time.Parse(time.RFC3339, chain.ExpirationTime)
	var port uint16
	if p := w.ApplicationTunnel.Port; p != nil {
		port = *p
	}
	var epPort uint16
	if ep := svc.Endpoints[w.UID]; ep != nil {
		epPort = ep.Port[443]
	}
	// What istioctl's views print, read back through its types.
	for _, c := range []struct{ what, got, want string }{
		{"workload", w.Namespace + "/" + w.Name + " " + w.Network + " " + w.WorkloadIPs[0] + " " + w.Node + " " + w.Protocol, "default/app net1 10.0.0.1 node-a HBONE"},
		{"workload waypoint", fmt.Sprint(w.Waypoint), "&{default/waypoint.default.svc.cluster.local}"},
		{"workload tunnel and locality", fmt.Sprintf("%s %d %v", w.ApplicationTunnel.Protocol, port, w.Locality), "PROXY 15088 {r1 z1 s1}"},
		{"service", svc.Namespace + "/" + svc.Name + " " + strings.Join(svc.Addresses, ",") + " " + svc.IPFamilies, "default/app net1/10.96.0.1,net1/fd00:96::1,/10.100.0.0/16 Dual"},
		{"service endpoint port 443", fmt.Sprint(epPort), "8443"},
		{"service load balancer", fmt.Sprint(svc.LoadBalancer), "&{Failover [Network Region Zone Subzone] AllowAll}"},
		{"policy", pol.Namespace + "/" + pol.Name + " " + pol.Action + " " + pol.Scope, "default/every-match Allow Namespace"},
		{"certificate", cert.Identity + " " + cert.State, app.String() + " Available"},
		{"certificate pem, serial, expiry", fmt.Sprintf("%v %x %v", block != nil && block.Type == "CERTIFICATE", serial, expires), "true 123456789abcdef 2100-01-01 00:00:00 +0000 UTC"},
		{"unavailable certificate", d.Certificates[1].Identity + " " + d.Certificates[1].State, broken.String() + " Unavailable: fixed ca: no certificate for " + broken.String()},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %q; want %q", c.what, c.got, c.want)
		}
	}
}

// TestKernelTLSDump: the kernelTls section counts proxied connections by where their
// HBONE leg's TLS runs; plain TCP ones are not counted.
func TestKernelTLSDump(t *testing.T) {
	got := kernelTLSDump(true, false, [][]proxy.ConnInfo{
		{{Protocol: "HBONE", TLS: "kernel"}, {Protocol: "TCP"}},
		{{Protocol: "HBONE", TLS: "user"}, {Protocol: "HBONE", TLS: "kernel"}},
	})
	b, _ := json.Marshal(got)
	if want := `{"enabled":true,"keyUpdates":{"followed":false,"kernelSupports":false},"proxiedConnections":{"kernel":2,"user":1}}`; string(b) != want {
		t.Errorf("kernelTls = %s, want %s", b, want)
	}
}
