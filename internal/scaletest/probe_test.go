package scaletest

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// probe is traffic through the node at a fixed rate for the whole run: every interval a
// connection through the node's SOCKS5 listener to an echo server outside the mesh (the
// node looks the destination up in its store, finds nothing, and passes it through), one
// byte there and back. Its latency rises when the node's lookups stall behind a push (or
// the process stalls for a GC), so the worst one inside a window is that window's stall.
type probe struct {
	socks  string
	echo   net.Listener
	target netip.AddrPort
	stop   chan struct{}
	wg     sync.WaitGroup

	mu      sync.Mutex
	samples []sample
}

type sample struct {
	at  time.Time // when the connection started
	d   time.Duration
	err error
}

// newEcho listens on a loopback address of its own.
func newEcho() (net.Listener, error) {
	return net.Listen("tcp", fmt.Sprintf("127.%d.%d.%d:7070", 100+rand.IntN(100), rand.IntN(250), 1+rand.IntN(250)))
}

func startProbe(echo net.Listener, socks string, every time.Duration) *probe {
	p := &probe{socks: socks, echo: echo, target: netip.MustParseAddrPort(echo.Addr().String()), stop: make(chan struct{})}
	p.wg.Add(2)
	go p.serveEcho()
	go p.run(every)
	return p
}

func (p *probe) serveEcho() {
	defer p.wg.Done()
	var conns sync.WaitGroup
	defer conns.Wait()
	for {
		c, err := p.echo.Accept()
		if err != nil {
			return
		}
		conns.Add(1)
		go func() {
			defer conns.Done()
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			_, _ = io.Copy(c, c)
		}()
	}
}

func (p *probe) run(every time.Duration) {
	defer p.wg.Done()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-tick.C:
		}
		start := time.Now()
		err := p.once()
		p.mu.Lock()
		p.samples = append(p.samples, sample{start, time.Since(start), err})
		p.mu.Unlock()
	}
}

// once is one SOCKS5 CONNECT through the node and a byte echoed.
func (p *probe) once() error {
	c, err := net.DialTimeout("tcp", p.socks, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	ip := p.target.Addr().As4()
	req := append([]byte{5, 1, 0, 5, 1, 0, 1}, ip[:]...)
	req = append(req, byte(p.target.Port()>>8), byte(p.target.Port()))
	if _, err := c.Write(req); err != nil {
		return err
	}
	var resp [2 + 10 + 1]byte
	if _, err := io.ReadFull(c, resp[:12]); err != nil {
		return err
	}
	if resp[3] != 0 {
		return fmt.Errorf("socks5 reply %d", resp[3])
	}
	if _, err := c.Write([]byte{'x'}); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, resp[12:]); err != nil || resp[12] != 'x' {
		return errors.Join(errors.New("no echo"), err)
	}
	return nil
}

func (p *probe) close() {
	close(p.stop)
	p.echo.Close()
	p.wg.Wait()
}

// window is what the probes started in [from, to) saw: the slowest (an answer the node
// refused counts: it looked the connection up too), how many ran and how many failed.
type window struct {
	worst     time.Duration
	n, failed int
	lastErr   error
}

func (w window) String() string {
	if w.n == 0 {
		return "-"
	}
	s := fmt.Sprintf("%v (%d", w.worst.Round(100*time.Microsecond), w.n)
	if w.failed > 0 {
		s += fmt.Sprintf(", %d failed", w.failed)
	}
	return s + ")"
}

func (p *probe) window(from, to time.Time) window {
	p.mu.Lock()
	defer p.mu.Unlock()
	var w window
	var ds []time.Duration
	for _, s := range p.samples {
		if s.at.Before(from) || !s.at.Before(to) {
			continue
		}
		w.n++
		ds = append(ds, s.d)
		if s.err != nil {
			w.failed++
			w.lastErr = s.err
		}
	}
	if len(ds) > 0 {
		w.worst = slices.Max(ds)
	}
	return w
}
