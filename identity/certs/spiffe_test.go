package certs_test

import (
	"context"
	"crypto/x509"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
)

// TestWorkloadAPIUpdate: the agent pushes a new SVID and bundle; the manager serves them
// without a restart and long before the old one's half-life.
func TestWorkloadAPIUpdate(t *testing.T) {
	leaktest.Check(t)
	agent := catest.StartAgent(t)
	root := catest.NewRoot(t, "root")
	now := time.Now()
	agent.Set(t, []*ca.Issued{root.Issue(t, idA, now, now.Add(time.Hour))}, nil)
	c, err := ca.New(context.Background(), ca.Config{SpiffeSocket: agent.Socket})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	m := certs.New(certs.Config{}, c)
	defer m.Close()
	old := mustCert(t, m, idA)

	root2, fed := catest.NewRoot(t, "root2"), catest.NewRoot(t, "federated")
	next := root2.Issue(t, idA, now, now.Add(time.Hour))
	agent.Set(t, []*ca.Issued{next}, map[string][]*x509.Certificate{"other.td": {fed.Cert}})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		got := mustCert(t, m, idA)
		if got.Certificate.Leaf.Equal(next.Certificate.Leaf) {
			if len(got.Roots) != 2 || !got.Roots[0].Equal(root2.Cert) || !got.Roots[1].Equal(fed.Cert) {
				t.Errorf("roots after update: %d certs; want new bundle then federated", len(got.Roots))
			}
			break
		}
		if !got.Certificate.Leaf.Equal(old.Certificate.Leaf) {
			t.Fatal("unexpected certificate")
		}
		if time.Now().After(deadline) {
			t.Fatal("pushed SVID not picked up")
		}
	}
}

// TestImports: identity packages sit below the data plane and must not import it.
func TestImports(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/gozt/gozt/identity/certs", "github.com/gozt/gozt/identity/ca").Output()
	if err != nil {
		t.Skipf("go list unavailable: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		for _, bad := range []string{"/proxy", "/xds", "/hbone", "/metrics", "/dns"} {
			if strings.HasPrefix(p, "github.com/gozt/gozt") && strings.Contains(p, bad) {
				t.Errorf("identity packages import %s", p)
			}
		}
	}
}
