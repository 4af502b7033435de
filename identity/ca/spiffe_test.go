package ca_test

import (
	"context"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/leaktest"
)

func hasRoot(roots []*x509.Certificate, r *catest.Root) bool {
	for _, c := range roots {
		if c.Equal(r.Cert) {
			return true
		}
	}
	return false
}

func TestSpiffeWorkloadAPI(t *testing.T) {
	leaktest.Check(t)
	agent := catest.StartAgent(t)
	root, fed := catest.NewRoot(t, "td root"), catest.NewRoot(t, "federated")
	now := time.Now()
	svidA := root.Issue(t, idA, now, now.Add(time.Hour))
	agent.Set(t, []*ca.Issued{svidA}, map[string][]*x509.Certificate{"other.td": {fed.Cert}})

	c := newClient(t, ca.Config{SpiffeSocket: agent.Socket}) // auto: spiffe; bare path
	n, ok := c.(ca.Notifier)
	if !ok {
		t.Fatalf("%T does not push updates", c)
	}
	iss, err := fetch(t, c, idA)
	if err != nil {
		t.Fatal(err)
	}
	if iss.Certificate.Leaf.SerialNumber.Cmp(svidA.Certificate.Leaf.SerialNumber) != 0 {
		t.Error("got a different SVID than the agent sent")
	}
	if !hasRoot(iss.Roots, root) || !hasRoot(iss.Roots, fed) {
		t.Errorf("roots = %d certs; want trust domain bundle and federated bundle", len(iss.Roots))
	}
	if _, err := fetch(t, c, idB); err == nil || !strings.Contains(err.Error(), "no SVID for "+idB.String()) {
		t.Errorf("fetch for an identity the agent does not serve: err = %v", err)
	}

	// The agent rotates: a new SVID signed by a new root, and a second identity.
	changed := n.Changed()
	root2 := catest.NewRoot(t, "td root 2")
	svidA2 := root2.Issue(t, idA, now, now.Add(time.Hour))
	svidB := root2.Issue(t, idB, now, now.Add(time.Hour))
	agent.Set(t, []*ca.Issued{svidA2, svidB}, nil)
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("no update notification after the agent pushed")
	}
	iss, err = fetch(t, c, idA)
	if err != nil {
		t.Fatal(err)
	}
	if iss.Certificate.Leaf.SerialNumber.Cmp(svidA2.Certificate.Leaf.SerialNumber) != 0 {
		t.Error("update not picked up: old SVID returned")
	}
	if !hasRoot(iss.Roots, root2) || hasRoot(iss.Roots, fed) {
		t.Error("bundle update not picked up")
	}
	if _, err := fetch(t, c, idB); err != nil {
		t.Errorf("second identity after update: %v", err)
	}
	if s := agent.Streams(); s != 1 {
		t.Errorf("agent saw %d streams; want 1 long-lived stream", s)
	}
}

func TestSpiffeNoAgent(t *testing.T) {
	leaktest.Check(t)
	c := newClient(t, ca.Config{SpiffeSocket: t.TempDir() + "/none.sock"})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := c.Fetch(ctx, identity.MustParse("spiffe://cluster.local/ns/a/sa/a"))
	if err == nil || !strings.Contains(err.Error(), "workload API") {
		t.Fatalf("err = %v; want workload API error", err)
	}
}
