package proxy_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// deniedFlood is a peer with a valid certificate that sends CONNECTs to target, which the
// policy denies, as fast as the node answers them: up to inFlight streams outstanding on one
// mTLS connection, a new one for each answer, again on a new connection if the node closes
// it. It returns the answers by status and the connections it used.
func deniedFlood(addr, target string, cfg *tls.Config, deadline time.Time) (statuses map[string]int, conns int, err error) {
	statuses = map[string]int{}
	for time.Now().Before(deadline) {
		tc, err := tls.Dial("tcp", addr, cfg)
		if err != nil {
			return statuses, conns, err
		}
		conns++
		deniedFloodConn(tc, target, deadline, statuses)
		tc.Close()
	}
	return statuses, conns, nil
}

func deniedFloodConn(tc *tls.Conn, target string, deadline time.Time, statuses map[string]int) {
	const inFlight = 100
	fr := http2.NewFramer(tc, tc)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	var wmu sync.Mutex // the writer's Framer side and hbuf
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	slots := make(chan struct{}, inFlight)
	readDone := make(chan struct{})
	go func() { // the answers: each frees a slot
		defer close(readDone)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.MetaHeadersFrame:
				statuses[f.PseudoValue("status")]++
				<-slots
			case *http2.SettingsFrame:
				if !f.IsAck() {
					wmu.Lock()
					fr.WriteSettingsAck()
					wmu.Unlock()
				}
			case *http2.GoAwayFrame:
				statuses["GOAWAY "+f.ErrCode.String()]++
			}
		}
	}()
	wmu.Lock()
	_, err := tc.Write([]byte(http2.ClientPreface))
	if err == nil {
		err = fr.WriteSettings()
	}
	wmu.Unlock()
	for id := uint32(1); err == nil && time.Now().Before(deadline); id += 2 {
		select {
		case slots <- struct{}{}:
		case <-readDone:
			return
		}
		wmu.Lock()
		hbuf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		enc.WriteField(hpack.HeaderField{Name: ":authority", Value: target})
		err = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndHeaders: true})
		wmu.Unlock()
	}
	tc.Close()
	<-readDone
}

// TestDeniedConnectFlood: a peer with a valid identity sends CONNECTs to a port the policy
// denies, as fast as node B answers them, from four connections, while a client keeps
// making requests through node A to an allowed backend. Each denial is answered 401 and
// recorded (a denial is a policy decision worth its access-log record, not junk), the
// node's goroutines, fds and heap stay bounded, nothing leaks, and the victim is served.
func TestDeniedConnectFlood(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	denied := startBackend(t, m.serverIP+":0", echo)
	m.b.store.Apply(&state.Batch{Policies: []*state.Policy{{
		Name: "deny-port", Namespace: "default", Scope: state.ScopeNamespace, Action: state.ActionDeny,
		Rules: []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{{DestinationPorts: []uint16{denied.port()}}}}}}},
	}}})
	target := net.JoinHostPort(m.serverIP, strconv.Itoa(int(denied.port())))
	cfg, err := m.a.certs.ClientConfig(context.Background(), identity.MustParse("spiffe://"+clientPrinc),
		[]identity.ID{identity.MustParse("spiffe://" + serverPrinc)})
	if err != nil {
		t.Fatal(err)
	}
	cfg = cfg.Clone()
	cfg.NextProtos = []string{http2.NextProtoTLS}

	victim, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	if err := pingEcho(victim, "warm"); err != nil {
		t.Fatal(err)
	}
	// The victim's rate with no attack, for the log: these attackers share the CPUs.
	base := 0
	for start := time.Now(); time.Since(start) < time.Second; base++ {
		if err := pingEcho(victim, "baseline"); err != nil {
			t.Fatal(err)
		}
	}
	denyFlags := map[string]string{"reporter": "destination", "response_flags": metrics.FlagDeny}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap0, g0, f0 := ms.HeapInuse, runtime.NumGoroutine(), fdCount(t)

	const attackers, attack = 4, 2 * time.Second
	deadline := time.Now().Add(attack)
	var heapPeak uint64
	var gPeak, fPeak int
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var ms runtime.MemStats
		for time.Now().Before(deadline) {
			runtime.ReadMemStats(&ms)
			heapPeak = max(heapPeak, ms.HeapInuse)
			gPeak = max(gPeak, runtime.NumGoroutine())
			fPeak = max(fPeak, fdCount(t))
			time.Sleep(20 * time.Millisecond)
		}
	}()
	var served atomic.Int64
	victimDone := make(chan error, 1)
	go func() {
		for i := 0; time.Now().Before(deadline); i++ {
			if err := pingEcho(victim, fmt.Sprintf("request %d", i)); err != nil {
				victimDone <- fmt.Errorf("request %d: %w", i, err)
				return
			}
			served.Add(1)
		}
		victimDone <- nil
	}()
	var wg sync.WaitGroup
	var mu sync.Mutex
	statuses := map[string]int{}
	conns := 0
	for range attackers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, c, err := deniedFlood(m.serverIP+":15008", target, cfg, deadline)
			if err != nil {
				t.Errorf("attacker: %v", err)
			}
			mu.Lock()
			defer mu.Unlock()
			conns += c
			for k, v := range st {
				statuses[k] += v
			}
		}()
	}
	wg.Wait()
	if err := <-victimDone; err != nil {
		t.Errorf("victim during the attack: %v", err)
	}
	<-sampled
	var recorded float64
	testutil.Eventually(t, "node B to record every answered denial", func() bool {
		recorded = counter(t, m.b.reg, "istio_tcp_connections_closed_total", denyFlags)
		return recorded >= float64(statuses["401"])
	})
	t.Logf("%d CONNECTs answered on %d connections (%v), %v DENY records; victim: %d requests (%d in 1 s before the attack); peaks: %d goroutines (from %d), %d fds (from %d), heap in use %.1f MiB (from %.1f); process %s",
		statuses["401"], conns, statuses, recorded, served.Load(), base, gPeak, g0, fPeak, f0,
		float64(heapPeak)/(1<<20), float64(heap0)/(1<<20), peakRSS())
	if statuses["401"] == 0 || len(statuses) != 1 {
		t.Errorf("answers %v; want only 401s", statuses)
	}
	if conns != attackers {
		t.Errorf("the attackers needed %d connections; a denied CONNECT must not close its connection", conns)
	}
	if got := denied.accepted.Load(); got != 0 {
		t.Errorf("the denied backend accepted %d connections", got)
	}
	// Denials end in the handler at once: a few handlers per attacking connection, never
	// a backend socket.
	if limit := g0 + attackers*200 + 100; gPeak > limit {
		t.Errorf("goroutines peaked at %d during the attack (from %d), want at most %d", gPeak, g0, limit)
	}
	if limit := f0 + attackers + 50; fPeak > limit {
		t.Errorf("fds peaked at %d during the attack (from %d), want at most %d", fPeak, f0, limit)
	}
	if served.Load() < 5 {
		t.Errorf("the victim made %d requests during the attack, want at least 5", served.Load())
	}
	testutil.Eventually(t, "heap in use back within 16 MiB of its size before the attack", func() bool {
		runtime.GC()
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse < heap0+16<<20
	})
}
