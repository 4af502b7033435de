package identity_test

import (
	"crypto/x509"
	"encoding/json"
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/gozt/gozt/identity"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in          string
		td, ns, sa  string
		wantErr     bool
		wantNotMesh bool
	}{
		{in: "spiffe://cluster.local/ns/default/sa/sleep", td: "cluster.local", ns: "default", sa: "sleep"},
		{in: "spiffe://example.org/ns/a-b/sa/c.d", td: "example.org", ns: "a-b", sa: "c.d"},
		{in: "spiffe://cluster.local/ns/default/sa/sleep/extra", wantErr: true, wantNotMesh: true},
		{in: "spiffe://cluster.local/ns/default", wantErr: true, wantNotMesh: true},
		{in: "spiffe://cluster.local/sa/x/ns/y", wantErr: true, wantNotMesh: true},
		{in: "spiffe://cluster.local", wantErr: true, wantNotMesh: true},
		{in: "spiffe://cluster.local/ns//sa/x", wantErr: true},
		{in: "spiffe://Cluster.local/ns/a/sa/b", wantErr: true},
		{in: "http://cluster.local/ns/a/sa/b", wantErr: true},
		{in: "cluster.local/ns/a/sa/b", wantErr: true},
		{in: "spiffe://cluster.local/ns/a/sa/b/", wantErr: true},
		{in: "spiffe://cluster.local/ns/../sa/b", wantErr: true},
		{in: "spiffe://cluster.local/ns/a/sa/b?x", wantErr: true},
		{in: "", wantErr: true},
	} {
		id, err := identity.Parse(tc.in)
		if tc.wantErr {
			if err == nil {
				t.Errorf("Parse(%q) = %v; want error", tc.in, id)
			} else if tc.wantNotMesh && !errors.Is(err, identity.ErrNotMeshID) {
				t.Errorf("Parse(%q) error %v; want ErrNotMeshID", tc.in, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("Parse(%q): %v", tc.in, err)
			continue
		}
		if id.String() != tc.in || id.TrustDomain() != tc.td || id.Namespace() != tc.ns || id.ServiceAccount() != tc.sa {
			t.Errorf("Parse(%q) = %q td %q ns %q sa %q; want td %q ns %q sa %q", tc.in, id, id.TrustDomain(), id.Namespace(), id.ServiceAccount(), tc.td, tc.ns, tc.sa)
		}
		if got, want := id.Principal(), strings.TrimPrefix(tc.in, "spiffe://"); got != want {
			t.Errorf("Principal() = %q; want %q", got, want)
		}
	}
}

func TestNewDefaultsAndErrors(t *testing.T) {
	id, err := identity.New("", "ns1", "")
	if err != nil {
		t.Fatal(err)
	}
	if id.String() != "spiffe://cluster.local/ns/ns1/sa/default" {
		t.Errorf("New defaults = %q", id)
	}
	for _, parts := range [][3]string{{"td", "", "sa"}, {"td", "a/b", "sa"}, {"td", "ns", "a/b"}, {"td/x", "ns", "sa"}, {"TD", "ns", "sa"}, {"td", strings.Repeat("n", 3000), "sa"}} {
		if id, err := identity.New(parts[0], parts[1], parts[2]); err == nil {
			t.Errorf("New(%q) = %v; want error", parts, id)
		}
	}
}

func TestZero(t *testing.T) {
	var z identity.ID
	if !z.IsZero() || z.String() != "" || z.TrustDomain() != "" || z.Namespace() != "" || z.ServiceAccount() != "" || z.Principal() != "" {
		t.Error("zero ID is not empty")
	}
	if identity.MustParse("spiffe://a/ns/b/sa/c").IsZero() {
		t.Error("parsed ID reports zero")
	}
}

func TestText(t *testing.T) {
	type rec struct {
		ID   identity.ID `json:"id"`
		None identity.ID `json:"none"`
	}
	in := rec{ID: identity.MustParse("spiffe://td/ns/a/sa/b")}
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"id":"spiffe://td/ns/a/sa/b","none":""}` {
		t.Errorf("json = %s", b)
	}
	var out rec
	if err := json.Unmarshal(b, &out); err != nil || out != in {
		t.Errorf("round trip = %+v, %v; want %+v", out, err, in)
	}
	if err := json.Unmarshal([]byte(`{"id":"spiffe://td/x"}`), &out); err == nil {
		t.Error("non-mesh ID unmarshalled")
	}
}

func TestFromCert(t *testing.T) {
	u := func(s string) *url.URL { v, _ := url.Parse(s); return v }
	c := &x509.Certificate{URIs: []*url.URL{u("https://example.com"), u("spiffe://td/other"), u("spiffe://td/ns/a/sa/b")}}
	id, err := identity.FromCert(c)
	if err != nil || id.String() != "spiffe://td/ns/a/sa/b" {
		t.Errorf("FromCert = %v, %v; want the first mesh URI", id, err)
	}
	if _, err := identity.FromCert(&x509.Certificate{URIs: []*url.URL{u("spiffe://td/other")}}); !errors.Is(err, identity.ErrNotMeshID) {
		t.Errorf("FromCert without mesh URI: err = %v", err)
	}
}

// TestAllocs: IDs are map keys on the hot path; comparing and hashing must not allocate.
func TestAllocs(t *testing.T) {
	a := identity.MustParse("spiffe://cluster.local/ns/default/sa/sleep")
	b, _ := identity.New("cluster.local", "default", "sleep")
	m := map[identity.ID]int{a: 1}
	var sink int
	n := testing.AllocsPerRun(1000, func() {
		if a == b {
			sink += m[b]
		}
		sink += len(b.Namespace()) + len(b.TrustDomain()) + len(b.ServiceAccount()) + len(b.Principal())
	})
	if n != 0 {
		t.Errorf("compare+hash+accessors allocate %v times; want 0", n)
	}
	if sink == 0 {
		t.Error("equal IDs did not compare equal")
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"spiffe://cluster.local/ns/default/sa/sleep", "spiffe://a/ns/b/sa/c/d", "spiffe://td/ns//sa/x",
		"spiffe://td/ns/%2F/sa/x", "spiffe://td:80/ns/a/sa/b", "spiffe://td/ns/a/sa/b#f", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := identity.Parse(s)
		if err != nil {
			if !id.IsZero() {
				t.Fatalf("Parse(%q) failed but returned %v", s, id)
			}
			return
		}
		if id.String() != s {
			t.Fatalf("Parse(%q).String() = %q", s, id)
		}
		if id.IsZero() {
			t.Fatalf("Parse(%q) gave the zero ID", s)
		}
		want := "spiffe://" + id.TrustDomain() + "/ns/" + id.Namespace() + "/sa/" + id.ServiceAccount()
		if want != s || id.Principal() != strings.TrimPrefix(s, "spiffe://") {
			t.Fatalf("components of %q reassemble to %q", s, want)
		}
		for _, p := range []string{id.TrustDomain(), id.Namespace(), id.ServiceAccount()} {
			if p == "" || strings.Contains(p, "/") {
				t.Fatalf("Parse(%q) has bad component %q", s, p)
			}
		}
		again, err := identity.New(id.TrustDomain(), id.Namespace(), id.ServiceAccount())
		if err != nil || again != id {
			t.Fatalf("New(parts of %q) = %v, %v; want an equal ID", s, again, err)
		}
	})
}

func BenchmarkCompareHash(b *testing.B) {
	ids := make([]identity.ID, 64)
	m := make(map[identity.ID]int, len(ids))
	for i := range ids {
		ids[i], _ = identity.New("cluster.local", "ns", strings.Repeat("s", i+1))
		m[ids[i]] = i
	}
	probe, _ := identity.New("cluster.local", "ns", strings.Repeat("s", 33))
	b.ReportAllocs()
	var n int
	for b.Loop() {
		n += m[probe]
	}
	_ = n
}

func BenchmarkParse(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := identity.Parse("spiffe://cluster.local/ns/default/sa/sleep"); err != nil {
			b.Fatal(err)
		}
	}
}
