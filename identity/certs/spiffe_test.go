package certs_test

import (
	"context"
	"crypto/x509"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
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
	var got *ca.Issued
	testutil.Eventually(t, "the pushed SVID picked up", func() bool {
		got = mustCert(t, m, idA)
		if !got.Certificate.Leaf.Equal(next.Certificate.Leaf) && !got.Certificate.Leaf.Equal(old.Certificate.Leaf) {
			t.Fatal("unexpected certificate")
		}
		return got.Certificate.Leaf.Equal(next.Certificate.Leaf)
	})
	if len(got.Roots) != 2 || !got.Roots[0].Equal(root2.Cert) || !got.Roots[1].Equal(fed.Cert) {
		t.Errorf("roots after update: %d certs; want new bundle then federated", len(got.Roots))
	}
}
