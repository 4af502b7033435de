package hbone

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone/internal/testcert"
	"golang.org/x/net/http2"
)

// floodConn is what one hostile connection sends, frame after frame, until the server
// ends the connection.
type floodConn func(p *rawPeer, i int) error

var floods = []struct {
	name string
	send floodConn
}{
	{"rapid-reset", func(p *rawPeer, i int) error {
		id := uint32(2*i + 1)
		if err := p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80"); err != nil {
			return err
		}
		return p.write(func() error { return p.fr.WriteRSTStream(id, http2.ErrCodeCancel) })
	}},
	{"ping", func(p *rawPeer, i int) error {
		return p.write(func() error { return p.fr.WritePing(false, [8]byte{byte(i)}) })
	}},
	{"settings", func(p *rawPeer, i int) error { return p.write(func() error { return p.fr.WriteSettings() }) }},
	{"empty-data", func(p *rawPeer, i int) error {
		if i == 0 {
			if err := p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80"); err != nil {
				return err
			}
		}
		return p.write(func() error { return p.fr.WriteData(1, false, nil) })
	}},
}

// flood runs one attacker against addr until stop closes: over an mTLS connection it sends
// send(p, 0), send(p, 1), ... until the server ends the connection, then starts again on
// a new one. It returns the connections it used.
func flood(addr string, cfg *tls.Config, send floodConn, stop <-chan struct{}) int {
	conns := 0
	for {
		select {
		case <-stop:
			return conns
		default:
		}
		tc, err := tls.Dial("tcp", addr, cfg)
		if err != nil || send == nil {
			if tc != nil {
				tc.Close()
			}
			conns++
			continue // a refused handshake is the server's answer too
		}
		conns++
		p := newRawPeer(tc, true)
		go func() {
			for range p.frames {
			}
		}()
		for i := 0; ; i++ {
			if send(p, i) != nil {
				break
			}
			select {
			case <-stop:
				i = -2
			default:
			}
			if i < 0 {
				break
			}
		}
		tc.Close()
		<-p.done
	}
}

// handshakeFlood opens TCP connections to addr that never start TLS (half of them after a
// few bytes of a ClientHello), keeping up to hold of them open, until stop closes.
func handshakeFlood(addr string, hold int, stop <-chan struct{}) int {
	var open []net.Conn
	n := 0
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for {
		select {
		case <-stop:
			return n
		case <-time.After(time.Millisecond):
		}
		if len(open) == hold {
			open[0].Close()
			open = open[1:]
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			continue
		}
		if n%2 == 1 {
			c.Write([]byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00})
		}
		open = append(open, c)
		n++
	}
}

// BenchmarkVictimUnderAttack measures a well-behaved client's 1 KiB round trips (through
// a proxy-like handler to a TCP echo backend) while two hostile peers attack the same
// server, against the same with no attack ("none"). It reports the victim's p50 and p99
// and the server's heap growth. The attackers run in this process, so they also take
// CPU from the victim: a ratio to "none" bounds what the attack costs, it does not
// isolate the server's share.
func BenchmarkVictimUnderAttack(b *testing.B) {
	testCA()
	other := testcert.NewCA().ClientConfig(clientID) // a certificate the server does not trust
	attacks := []struct {
		name string
		run  func(addr string, stop <-chan struct{})
	}{{"none", nil}}
	for _, f := range floods {
		attacks = append(attacks, struct {
			name string
			run  func(string, <-chan struct{})
		}{f.name, func(addr string, stop <-chan struct{}) { flood(addr, cliTLS, f.send, stop) }})
	}
	attacks = append(attacks,
		struct {
			name string
			run  func(string, <-chan struct{})
		}{"no-tls", func(addr string, stop <-chan struct{}) { handshakeFlood(addr, 500, stop) }},
		struct {
			name string
			run  func(string, <-chan struct{})
		}{"untrusted-cert", func(addr string, stop <-chan struct{}) { flood(addr, other, nil, stop) }},
	)
	for _, a := range attacks {
		b.Run(a.name, func(b *testing.B) {
			backend, stopBackend := tcpEcho(b)
			defer stopBackend()
			e := newEnv(b, Config{}, proxyTo(backend))
			s := e.dial(b, "10.0.0.1:80")
			defer s.Close()
			msg := bytes.Repeat([]byte("v"), 1024)
			buf := make([]byte, len(msg))
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			heap0 := ms.HeapInuse
			stop := make(chan struct{})
			var wg sync.WaitGroup
			if a.run != nil {
				for range 2 {
					wg.Add(1)
					go func() { defer wg.Done(); a.run(e.ln.Addr().String(), stop) }()
				}
				time.Sleep(100 * time.Millisecond) // let the attack get going
			}
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if _, err := s.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(s, buf); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			runtime.ReadMemStats(&ms)
			close(stop)
			wg.Wait()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
			b.ReportMetric(float64(int64(ms.HeapInuse)-int64(heap0))/(1<<20), "heap-MiB")
		})
	}
}
