package proxy_test

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/gozt/gozt/internal/leaktest"
)

// resetFlood is a hostile peer with a valid certificate: it sends HEADERS(CONNECT target)
// then RST_STREAM(CANCEL) in a loop on an mTLS connection to addr, and again on a new one
// whenever the node closes it, until the deadline. It returns the streams it opened and
// the connections it used. A connection the node refuses (its per-source and
// per-identity budgets slow a peer that reconnects after each calm close) is tried again.
func resetFlood(t *testing.T, addr, target string, cfg *tls.Config, deadline time.Time) (streams, conns int) {
	for time.Now().Before(deadline) {
		tc, err := tls.Dial("tcp", addr, cfg)
		if err != nil {
			if !isRefusal(err) {
				t.Errorf("attacker: %v", err)
				return
			}
			continue
		}
		conns++
		streams += resetFloodConn(tc, target, deadline)
		tc.Close()
	}
	return streams, conns
}

// isRefusal reports whether err is the node refusing a connection before its
// handshake: an RST (or its EOF), not a TLS alert.
func isRefusal(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE)
}

// peakRSS is the process's peak resident memory, as /proc/self/status says.
func peakRSS() string {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmHWM:") {
			return "peak RSS " + strings.Join(strings.Fields(line)[1:], " ")
		}
	}
	return "peak RSS unknown"
}

func resetFloodConn(tc *tls.Conn, target string, deadline time.Time) int {
	fr := http2.NewFramer(tc, tc)
	var hbuf bytes.Buffer
	enc := hpack.NewEncoder(&hbuf)
	go func() { // read and drop what the node sends, so its writes never block on us
		var buf [32 << 10]byte
		for {
			if _, err := tc.Read(buf[:]); err != nil {
				return
			}
		}
	}()
	if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil || fr.WriteSettings() != nil {
		return 0
	}
	n := 0
	for id := uint32(1); time.Now().Before(deadline); id += 2 {
		hbuf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
		enc.WriteField(hpack.HeaderField{Name: ":authority", Value: target})
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndHeaders: true}) != nil ||
			fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
			break // the node closed the connection
		}
		n++
	}
	return n
}

// TestRapidResetThroughNodes floods node B's 15008 with rapid resets (CVE-2023-44487)
// from four connections presenting node A's valid client identity, while a client keeps
// making requests through node A to a backend behind node B. The node's goroutines, fds
// and heap stay bounded, the attackers are told to calm down, the streams they reset
// leave no access-log record, and the victim's requests keep succeeding.
func TestRapidResetThroughNodes(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	target := net.JoinHostPort(m.serverIP, strconv.Itoa(int(be.port())))
	cfg := attackerTLS(t, m)
	victim, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close()
	opened0 := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil)

	const attackers = 4
	var streams, conns atomic.Int64
	run := duringAttack(t, victim, func() {
		deadline := time.Now().Add(2 * time.Second)
		var wg sync.WaitGroup
		for range attackers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, c := resetFlood(t, m.serverIP+":15008", target, cfg, deadline)
				streams.Add(int64(s))
				conns.Add(int64(c))
			}()
		}
		wg.Wait()
	})

	calmed := counter(t, m.b.reg, "hbone_dropped_total", map[string]string{"reason": "enhance_your_calm"})
	early := counter(t, m.b.reg, "hbone_dropped_total", map[string]string{"reason": "reset_unanswered"}) +
		counter(t, m.b.reg, "hbone_dropped_total", map[string]string{"reason": "refused"})
	recorded := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil) - opened0
	t.Logf("%d attacking streams on %d connections (%v calmed, %v streams dropped unanswered, %v recorded); %v",
		streams.Load(), conns.Load(), calmed, early, recorded, run)
	// Reconnects after a calm close wait, or are closed after their handshake by the
	// per-identity budget.
	budget := counter(t, m.b.reg, "hbone_dropped_total", map[string]string{"reason": "peer_connection_rate"})
	if calmed+budget < float64(conns.Load()-attackers) || calmed == 0 {
		t.Errorf("node B closed %v of %d attacking connections with ENHANCE_YOUR_CALM and %v for its budget", calmed, conns.Load(), budget)
	}
	// The limit is node B's 200 streams per connection; a handler whose stream was reset
	// returns at once, so a connection holds far fewer. Goroutines: a handler and a copy
	// per slot, 100 for the two nodes and the test. Fds: a backend socket pair per slot.
	if limit := run.g0 + attackers*2*200 + 100; run.gPeak > limit {
		t.Errorf("goroutines peaked at %d during the attack (from %d), want at most %d", run.gPeak, run.g0, limit)
	}
	if limit := run.f0 + attackers*2*200 + 50; run.fPeak > limit {
		t.Errorf("fds peaked at %d during the attack (from %d), want at most %d", run.fPeak, run.f0, limit)
	}
	// A stream answered before its reset arrived is a real connection, with its record;
	// the rest leave none, so the records are a small part of the streams.
	if recorded > float64(streams.Load())/4 {
		t.Errorf("node B recorded %v connections for %d reset streams: resets before the answer must leave no record", recorded, streams.Load())
	}
	heapReturns(t, run.heap0)
}
