package certs_test

import (
	"context"
	"crypto/tls"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
)

// scripted is a per-workload source the test pushes by hand (SPIRE's agent in
// identity/ca's TestDelegatedSPIRE and cmd/ztunnel's TestSpireInPod).
type scripted struct {
	mu    sync.Mutex
	subs  map[string]func(ca.SVIDs) // by the workload's first selector value
	stops int
}

func (s *scripted) Fetch(context.Context, identity.ID) (*ca.Issued, error) {
	return nil, errors.New("per workload")
}
func (s *scripted) Close() error { return nil }

func (s *scripted) Subscribe(w ca.DelegatedWorkload, push func(ca.SVIDs)) func() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.subs[w.Selectors[0].Value] = push
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.subs, w.Selectors[0].Value)
		s.stops++
	}
}

func (s *scripted) push(t *testing.T, key string, u ca.SVIDs) {
	t.Helper()
	s.mu.Lock()
	push := s.subs[key]
	s.mu.Unlock()
	if push == nil {
		t.Fatalf("no subscription for %s", key)
	}
	push(u)
}

func ref(key string) certs.WorkloadRef {
	return certs.WorkloadRef{Key: key, Name: "ns/" + key, As: ca.DelegatedWorkload{Selectors: []ca.Selector{{Type: "k8s", Value: key}}}}
}

// TestWorkloadCerts: two pods of one identity hold an SVID each, and each pod's source
// presents its own, in a real handshake; a pod with none yet waits for the agent's push; a
// withdrawn SVID is reported, refused at once and ends nothing of the other pod's; the last
// release stops the subscription.
func TestWorkloadCerts(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "spire")
	now := time.Now()
	src := &scripted{subs: map[string]func(ca.SVIDs){}}
	withdrawn := make(chan string, 4)
	m := certs.New(certs.Config{FetchTimeout: 5 * time.Second, OnWithdraw: func(key string) { withdrawn <- key }}, src)
	defer m.Close()

	podA, releaseA, err := m.Workload(ref("a"))
	if err != nil {
		t.Fatal(err)
	}
	podA2, releaseA2, _ := m.Workload(ref("a")) // the same pod again (a restarted proxy): one subscription
	podB, releaseB, _ := m.Workload(ref("b"))
	svidA, svidB := root.Issue(t, idA, now, now.Add(time.Hour)), root.Issue(t, idA, now, now.Add(2*time.Hour)) // b lasts longer: a lookup by identity alone would pick it

	// Pod a's first connection waits for the agent's first push: until its deadline, or
	// until the push.
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := podA.ClientConfig(short, idA, []identity.ID{idA}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("pod a before any push: %v; want it to wait out its deadline", err)
	}
	got := make(chan error, 1)
	go func() {
		_, err := podA.ClientConfig(context.Background(), idA, []identity.ID{idA})
		got <- err
	}()
	src.push(t, "a", ca.SVIDs{Issued: []*ca.Issued{svidA}})
	if err := <-got; err != nil {
		t.Fatalf("pod a after the push: %v", err)
	}
	src.push(t, "b", ca.SVIDs{Issued: []*ca.Issued{svidB}})

	// Each pod presents its own SVID, though both carry idA.
	cc, err := podA2.ClientConfig(context.Background(), idA, []identity.ID{idA})
	if err != nil {
		t.Fatal(err)
	}
	sc := podB.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idA, nil })
	r := handshake(t, cc, sc)
	if r.clientErr != nil || r.serverErr != nil {
		t.Fatalf("handshake: client %v, server %v", r.clientErr, r.serverErr)
	}
	if !r.client.PeerCertificates[0].Equal(svidB.Certificate.Leaf) || !r.server.PeerCertificates[0].Equal(svidA.Certificate.Leaf) {
		t.Error("a pod presented another pod's SVID")
	}
	if _, err := podA.ClientConfig(context.Background(), idB, []identity.ID{idA}); err == nil || !strings.Contains(err.Error(), "no valid SVID for "+idB.String()) {
		t.Errorf("pod a as an identity it has no SVID for: %v", err)
	}
	if d := m.Dump(); len(d) != 2 || d[0].Workload != "ns/a" || d[0].Source != "spire: selectors k8s:a" || d[0].State != "Available" {
		t.Errorf("dump = %+v", d)
	}
	if err := m.WorkloadsReady(); err != nil {
		t.Errorf("ready with both SVIDs: %v", err)
	}

	// The agent withdraws pod b's SVID: reported, refused at once; pod a keeps its own and
	// a by-identity lookup (node mode) falls back to it.
	src.push(t, "b", ca.SVIDs{})
	select {
	case key := <-withdrawn:
		if key != "b" {
			t.Errorf("withdrawn %q; want b", key)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("OnWithdraw not called")
	}
	start := time.Now()
	if _, err := podB.ClientConfig(context.Background(), idA, []identity.ID{idA}); err == nil || !strings.Contains(err.Error(), "no SVID") {
		t.Errorf("pod b after its withdrawal: %v", err)
	} else if time.Since(start) > time.Second {
		t.Errorf("pod b's refusal took %v; want it at once", time.Since(start))
	}
	if err := m.WorkloadsReady(); err == nil || !strings.Contains(err.Error(), "ns/b") {
		t.Errorf("ready after b's withdrawal: %v; want it naming ns/b", err)
	}
	if c, err := m.Certificate(context.Background(), idA); err != nil || !c.Certificate.Leaf.Equal(svidA.Certificate.Leaf) {
		t.Errorf("by identity after b's withdrawal: %v", err)
	}

	// The agent going away keeps what a workload holds.
	src.push(t, "a", ca.SVIDs{Err: errors.New("agent restarting")})
	if _, err := podA.ClientConfig(context.Background(), idA, []identity.ID{idA}); err != nil {
		t.Errorf("pod a while the agent is away: %v", err)
	}

	releaseA()
	releaseA() // idempotent
	if _, err := podA2.ClientConfig(context.Background(), idA, []identity.ID{idA}); err != nil {
		t.Errorf("pod a with a holder left: %v", err)
	}
	releaseA2()
	releaseB()
	if src.stops != 2 {
		t.Errorf("%d subscriptions stopped; want 2", src.stops)
	}
	if _, err := podA.ClientConfig(context.Background(), idA, []identity.ID{idA}); err == nil {
		t.Error("pod a's certificates outlived its subscription")
	}
}
