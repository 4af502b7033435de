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

// attackRun is what duringAttack saw: node resources before and at their peak, and the
// victim's round trips with no attack (in the second before) and during it.
type attackRun struct {
	heap0, heapPeak uint64
	g0, gPeak       int
	f0, fPeak       int
	base, served    int64
}

func (r attackRun) String() string {
	return fmt.Sprintf("victim: %d round trips during the attack (%d in 1 s before it); peaks: %d goroutines (from %d), %d fds (from %d), heap in use %.1f MiB (from %.1f); process %s",
		r.served, r.base, r.gPeak, r.g0, r.fPeak, r.f0, float64(r.heapPeak)/(1<<20), float64(r.heap0)/(1<<20), peakRSS())
}

// duringAttack runs attack while sampling this process's goroutines, fds and heap and
// while a victim makes echo round trips, one after another, on its connection through the
// nodes, until attack returns. The attackers share the machine's CPUs with the nodes, so
// the victim's rate says little about the node: tests only require that it keeps being
// served.
func duringAttack(t *testing.T, victim net.Conn, attack func()) attackRun {
	t.Helper()
	var r attackRun
	for start := time.Now(); time.Since(start) < time.Second; r.base++ {
		if err := pingEcho(victim, "baseline"); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	r.heap0, r.g0, r.f0 = ms.HeapInuse, runtime.NumGoroutine(), fdCount(t)
	over := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		var ms runtime.MemStats
		for {
			runtime.ReadMemStats(&ms)
			r.heapPeak = max(r.heapPeak, ms.HeapInuse)
			r.gPeak = max(r.gPeak, runtime.NumGoroutine())
			r.fPeak = max(r.fPeak, fdCount(t))
			select {
			case <-over:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	victimDone := make(chan error, 1)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-over:
				victimDone <- nil
				return
			default:
			}
			if err := pingEcho(victim, fmt.Sprintf("request %d", i)); err != nil {
				victimDone <- fmt.Errorf("request %d: %w", i, err)
				return
			}
			r.served++
		}
	}()
	attack()
	close(over)
	if err := <-victimDone; err != nil {
		t.Errorf("victim during the attack: %v", err)
	}
	<-sampled
	if r.served == 0 {
		t.Error("the victim made no round trip during the attack")
	}
	return r
}

// heapReturns waits for the heap in use to come back within 16 MiB of heap0.
func heapReturns(t *testing.T, heap0 uint64) {
	t.Helper()
	var ms runtime.MemStats
	testutil.Eventually(t, "heap in use back within 16 MiB of its size before the attack", func() bool {
		runtime.GC()
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse < heap0+16<<20
	})
}

// attackerTLS is node A's client identity, for a raw HTTP/2 peer to present to node B.
func attackerTLS(t *testing.T, m *mesh) *tls.Config {
	t.Helper()
	cfg, err := m.a.certs.ClientConfig(context.Background(), identity.MustParse("spiffe://"+clientPrinc),
		[]identity.ID{identity.MustParse("spiffe://" + serverPrinc)})
	if err != nil {
		t.Fatal(err)
	}
	cfg = cfg.Clone()
	cfg.NextProtos = []string{http2.NextProtoTLS}
	return cfg
}

// TestDeniedConnectFlood: a peer with a valid identity sends CONNECTs to a port the policy
// denies, as fast as node B answers them, from four connections, while a client keeps
// making requests through node A to an allowed backend. Each denial is answered 401 and
// recorded (a denial is a policy decision worth its access-log record, not junk), the
// connections stay up, the node's goroutines, fds and heap stay bounded, nothing leaks,
// and the victim is served.
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
	cfg := attackerTLS(t, m)
	victim, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()

	const attackers = 4
	var mu sync.Mutex
	statuses := map[string]int{}
	conns := 0
	run := duringAttack(t, victim, func() {
		deadline := time.Now().Add(2 * time.Second)
		var wg sync.WaitGroup
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
	})
	denyFlags := map[string]string{"reporter": "destination", "response_flags": metrics.FlagDeny}
	var recorded float64
	testutil.Eventually(t, "node B to record every answered denial", func() bool {
		recorded = counter(t, m.b.reg, "istio_tcp_connections_closed_total", denyFlags)
		return recorded >= float64(statuses["401"])
	})
	t.Logf("%d CONNECTs answered on %d connections (%v), %v DENY records; %v", statuses["401"], conns, statuses, recorded, run)
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
	if limit := run.g0 + attackers*200 + 100; run.gPeak > limit {
		t.Errorf("goroutines peaked at %d during the attack (from %d), want at most %d", run.gPeak, run.g0, limit)
	}
	if limit := run.f0 + attackers + 50; run.fPeak > limit {
		t.Errorf("fds peaked at %d during the attack (from %d), want at most %d", run.fPeak, run.f0, limit)
	}
	heapReturns(t, run.heap0)
}

// hoseData is what TestZeroWindowHeldForever's backends send, shared so that their buffers
// do not count in the heap the test measures.
var hoseData [64 << 10]byte

// TestZeroWindowHeldForever: a peer with a valid identity advertises a stream window of 0,
// opens node B's limit of streams to a backend that sends without end, answers PINGs and
// never opens a window. Legal HTTP/2 (a client whose consumers stalled looks the same),
// so the node keeps the connection, but what it holds is bounded: a handler, a backend
// socket and at most one copy buffer per stream, and nothing once the peer goes.
func TestZeroWindowHeldForever(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	var firehoses atomic.Int64
	hose := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		firehoses.Add(1)
		for {
			if _, err := c.Write(hoseData[:]); err != nil {
				return
			}
		}
	})
	target := net.JoinHostPort(m.serverIP, strconv.Itoa(int(hose.port())))
	cfg := attackerTLS(t, m)
	victim, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()

	const attackers, streams = 2, 200
	var opened, answered atomic.Int64
	var held uint64 // heap in use after a GC while every stream is held
	run := duringAttack(t, victim, func() {
		var wg sync.WaitGroup
		var ready atomic.Int32
		allAnswered := func() { // on the last attacker to have all its streams answered
			if ready.Add(1) == attackers {
				runtime.GC()
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				held = ms.HeapInuse
			}
		}
		for range attackers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				o, a, err := zeroWindowPeer(m.serverIP+":15008", target, cfg, streams, time.Second, allAnswered)
				if err != nil {
					t.Errorf("attacker: %v", err)
				}
				opened.Add(int64(o))
				answered.Add(int64(a))
			}()
		}
		wg.Wait()
	})
	t.Logf("%d streams opened, %d answered 200, %d backend connections; %v", opened.Load(), answered.Load(), firehoses.Load(), run)
	if answered.Load() != attackers*streams {
		t.Errorf("%d of %d zero-window streams answered; want all (the limit is per connection)", answered.Load(), attackers*streams)
	}
	// Per stream: the copy's goroutine, the handler's (which waits up to a second to be
	// reused after handing off), the backend's writer (in this process) and a backend
	// socket's two ends; 100 for the nodes and the test.
	if limit := run.g0 + attackers*streams*3 + 100; run.gPeak > limit {
		t.Errorf("goroutines peaked at %d (from %d), want at most %d", run.gPeak, run.g0, limit)
	}
	if limit := run.f0 + attackers*(streams*2+1) + 50; run.fPeak > limit {
		t.Errorf("fds peaked at %d (from %d), want at most %d", run.fPeak, run.f0, limit)
	}
	// The stream's and the proxied connection's state, about 6 KiB; no copy buffer (16 KiB
	// or more), as ReadFrom waits for window before it borrows one.
	per := float64(held-min(run.heap0, held)) / (attackers * streams)
	t.Logf("live heap while the streams are held: %.1f MiB, %.1f KiB per stream", float64(held)/(1<<20), per/1024)
	limit := 12.0 // KiB
	if raceEnabled {
		limit = 32 // 5 to 18 KiB seen
	}
	if held == 0 || per > limit*1024 {
		t.Errorf("heap grew by %.1f KiB per zero-window stream, want at most %.0f", per/1024, limit)
	}
	heapReturns(t, run.heap0)
}

// zeroWindowPeer opens streams CONNECTs to target on one mTLS connection with a stream
// window of 0, answers PINGs and SETTINGS, reads and drops the rest until every stream is
// answered (or three times testutil.Timeout passes: the streams' backend dials queue on a
// loaded machine), calls onAnswered and holds them for hold, then
// closes. It returns the streams opened and those answered 200.
func zeroWindowPeer(addr, target string, cfg *tls.Config, streams int, hold time.Duration, onAnswered func()) (opened, answered int, err error) {
	tc, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		return 0, 0, err
	}
	defer tc.Close()
	fr := http2.NewFramer(tc, tc)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil {
		return 0, 0, err
	}
	if err := fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}); err != nil {
		return 0, 0, err
	}
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	for i := range streams {
		hbuf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		enc.WriteField(hpack.HeaderField{Name: ":authority", Value: target})
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: hbuf.Bytes(), EndHeaders: true}); err != nil {
			return opened, answered, err
		}
		opened++
	}
	tc.SetReadDeadline(time.Now().Add(3 * testutil.Timeout))
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return opened, answered, nil // the deadline
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			if f.PseudoValue("status") == "200" {
				if answered++; answered == streams {
					onAnswered()
					tc.SetReadDeadline(time.Now().Add(hold))
				}
			}
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				fr.WritePing(true, f.Data)
			}
		case *http2.DataFrame:
			if len(f.Data()) > 0 {
				return opened, answered, fmt.Errorf("node sent %d bytes of DATA on stream %d into a zero window", len(f.Data()), f.StreamID)
			}
		}
	}
}
