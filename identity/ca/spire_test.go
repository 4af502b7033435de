package ca_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/spiretest"
)

// delegateID is the SPIFFE ID the tests' SPIRE agent accepts as a delegate; the test process
// gets it through an entry for its program (the agent's unix attestor).
const delegateID = "spiffe://cluster.local/ztunnel"

// startDelegate runs SPIRE with this process as its authorized delegate.
func startDelegate(t *testing.T) *spiretest.SPIRE {
	t.Helper()
	sp := spiretest.Start(t, delegateID)
	sp.Register(t, "delegate", delegateID, 0, spiretest.ProgramSelector(t, ""))
	return sp
}

// follow subscribes to w and returns the pushes as they come.
func follow(t *testing.T, d *ca.Delegated, w ca.DelegatedWorkload) <-chan ca.SVIDs {
	t.Helper()
	ch := make(chan ca.SVIDs, 64)
	stop := d.Subscribe(w, func(u ca.SVIDs) {
		select {
		case ch <- u:
		default:
			t.Error("push channel full")
		}
	})
	t.Cleanup(stop)
	return ch
}

// next waits for a push that satisfies ok, failing t after within.
func next(t *testing.T, ch <-chan ca.SVIDs, within time.Duration, what string, ok func(ca.SVIDs) bool) ca.SVIDs {
	t.Helper()
	deadline := time.After(within)
	var last ca.SVIDs
	for {
		select {
		case u := <-ch:
			if ok(u) {
				return u
			}
			last = u
		case <-deadline:
			t.Fatalf("no push with %s within %v; last: %d SVIDs, err %v", what, within, len(last.Issued), last.Err)
		}
	}
}

// TestDelegatedSPIRE follows two workloads' SVIDs through a real SPIRE agent's Delegated
// Identity API: each gets its own SVID, by its selectors, with the trust domain's bundle as
// roots; an SVID the agent rotates is pushed; a deleted entry is pushed as none; selectors
// no entry matches get none.
func TestDelegatedSPIRE(t *testing.T) {
	leaktest.Check(t)
	sp := startDelegate(t)
	client := identity.MustParse("spiffe://cluster.local/ns/default/sa/client")
	server := identity.MustParse("spiffe://cluster.local/ns/default/sa/server")
	sp.Register(t, "client", client.String(), 0, "k8s:ns:default", "k8s:sa:client")
	sp.Register(t, "server", server.String(), 20*time.Second, "k8s:ns:default", "k8s:pod-uid:uid-b")

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := ca.New(ctx, ca.Config{SpireSocket: sp.AdminSocket}) // auto: spire
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	d, ok := c.(*ca.Delegated)
	if !ok {
		t.Fatalf("CA for SPIRE_ADMIN_ENDPOINT_SOCKET is %T", c)
	}
	if _, err := c.Fetch(ctx, client); err == nil || !strings.Contains(err.Error(), "per workload") {
		t.Errorf("Fetch by identity: err = %v; want an error saying SVIDs are per workload", err)
	}

	bundle := sp.Bundle(t)
	has := func(id identity.ID) func(ca.SVIDs) bool {
		return func(u ca.SVIDs) bool { return len(u.Issued) == 1 && mustID(t, u.Issued[0]) == id }
	}
	clientW := ca.DelegatedWorkload{Selectors: ca.K8sSelectors("default", "client", "client", "uid-a", "node-a")}
	serverW := ca.DelegatedWorkload{Selectors: ca.K8sSelectors("default", "server", "server", "uid-b", "node-a")}
	if got, want := serverW.String(), "selectors k8s:ns:default,k8s:sa:server,k8s:pod-name:server,k8s:pod-uid:uid-b,k8s:node-name:node-a"; got != want {
		t.Errorf("workload named %q; want %q", got, want)
	}
	clientSVIDs, serverSVIDs := follow(t, d, clientW), follow(t, d, serverW)
	nobody := follow(t, d, ca.DelegatedWorkload{Selectors: ca.K8sSelectors("default", "nobody", "", "", "")})

	cs := next(t, clientSVIDs, 30*time.Second, "the client's SVID", has(client))
	ss := next(t, serverSVIDs, 30*time.Second, "the server's SVID", has(server))
	for _, iss := range []*ca.Issued{cs.Issued[0], ss.Issued[0]} {
		if len(iss.Roots) != len(bundle) || !iss.Roots[0].Equal(bundle[0]) {
			t.Errorf("%s: roots = %d certificates; want the trust domain's bundle (%d)", mustID(t, iss), len(iss.Roots), len(bundle))
		}
	}
	// (Pushes of errors come first while the agent does not know the delegate's entry yet.)
	if u := next(t, nobody, 30*time.Second, "an answer", func(u ca.SVIDs) bool { return u.Err == nil }); len(u.Issued) != 0 {
		t.Errorf("selectors no entry matches: %d SVIDs; want none", len(u.Issued))
	}

	// The server's 20 s SVID is rotated by the agent at half its life.
	first := ss.Issued[0].Certificate.Leaf.SerialNumber
	rotated := next(t, serverSVIDs, 40*time.Second, "a rotated server SVID", func(u ca.SVIDs) bool {
		return has(server)(u) && u.Issued[0].Certificate.Leaf.SerialNumber.Cmp(first) != 0
	})
	if !rotated.Issued[0].NotAfter.After(ss.Issued[0].NotAfter) {
		t.Errorf("rotated SVID expires %v, not after the first's %v", rotated.Issued[0].NotAfter, ss.Issued[0].NotAfter)
	}

	sp.Delete(t, "server")
	next(t, serverSVIDs, 30*time.Second, "no SVID after the entry's deletion", func(u ca.SVIDs) bool { return u.Err == nil && len(u.Issued) == 0 })
}

func mustID(t *testing.T, iss *ca.Issued) identity.ID {
	t.Helper()
	id, err := iss.Identity()
	if err != nil {
		t.Fatal(err)
	}
	return id
}
