package scaletest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// probe is traffic through the node at a fixed rate for the whole run: every interval a
// connection through the node's SOCKS5 listener to an echo server outside the mesh (the
// node looks the destination up in its store, finds nothing, and passes it through), one
// byte there and back; then a DNS query to the node's DNS proxy for a service of the mesh
// (answered from the store). Their latency rises when the node's lookups stall behind a
// push (or the process stalls for a GC), so the worst one inside a window is that window's
// stall.
//
// The prober and the echo server run in a child process (this test binary again, see
// TestMain): in the test's own process they stalled whenever its collector worked over the
// ADS server's generated mesh (gigabytes at 1M), which put a floor of 10-35 ms under every
// window that was not the node's.
type probe struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	read  sync.WaitGroup

	mu      sync.Mutex
	samples []sample
}

type sample struct {
	kind string    // "conn" or "dns"
	at   time.Time // when the connection or query started
	d    time.Duration
	err  error
}

// probeEnv names the child's job: "socks-address dns-address name interval-in-nanoseconds".
const probeEnv = "SCALETEST_PROBE"

// startProbe probes through the node's SOCKS5 listener at socks and asks its DNS proxy at
// dnsAddr for name, every interval.
func startProbe(socks, dnsAddr, name string, every time.Duration) (*probe, error) {
	p := &probe{cmd: exec.Command(os.Args[0], "-test.run=^$")}
	p.cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s %s %d", probeEnv, socks, dnsAddr, name, every))
	p.cmd.Stderr = os.Stderr
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	p.read.Add(1)
	go func() {
		defer p.read.Done()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var at, d int64
			var kind, msg string
			if _, err := fmt.Sscanf(sc.Text(), "%s %d %d %q", &kind, &at, &d, &msg); err != nil {
				continue
			}
			s := sample{kind: kind, at: time.Unix(0, at), d: time.Duration(d)}
			if msg != "" {
				s.err = errors.New(msg)
			}
			p.mu.Lock()
			p.samples = append(p.samples, s)
			p.mu.Unlock()
		}
	}()
	return p, nil
}

func (p *probe) close() {
	p.stdin.Close() // the child stops when its stdin ends
	p.read.Wait()
	_ = p.cmd.Wait()
}

// runProbeChild is the child's main: it probes until its stdin ends, a line per sample.
func runProbeChild(job string) error {
	var socks, dnsAddr, name string
	var every time.Duration
	if _, err := fmt.Sscanf(job, "%s %s %s %d", &socks, &dnsAddr, &name, &every); err != nil {
		return fmt.Errorf("%s=%q: %v", probeEnv, job, err)
	}
	query := new(dns.Msg).SetQuestion(dns.Fqdn(name), dns.TypeA)
	dc := &dns.Client{Net: "udp", Timeout: 5 * time.Second}
	echo, err := net.Listen("tcp", fmt.Sprintf("127.%d.%d.%d:7070", 100+rand.IntN(100), rand.IntN(250), 1+rand.IntN(250)))
	if err != nil {
		return err
	}
	defer echo.Close()
	go serveEcho(echo)
	target := netip.MustParseAddrPort(echo.Addr().String())
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return nil
		case <-tick.C:
		}
		start := time.Now()
		err := probeOnce(socks, target)
		report(out, "conn", start, err)
		start = time.Now()
		err = lookupOnce(dc, query, dnsAddr)
		report(out, "dns", start, err)
		if err := out.Flush(); err != nil {
			return err
		}
	}
}

func report(out io.Writer, kind string, start time.Time, err error) {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	fmt.Fprintf(out, "%s %d %d %q\n", kind, start.UnixNano(), time.Since(start), msg)
}

// lookupOnce asks the DNS proxy at addr the query; an answer without an address fails.
func lookupOnce(dc *dns.Client, query *dns.Msg, addr string) error {
	resp, _, err := dc.Exchange(query, addr)
	if err != nil {
		return err
	}
	if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) == 0 {
		return fmt.Errorf("dns: %s, %d answers", dns.RcodeToString[resp.Rcode], len(resp.Answer))
	}
	return nil
}

func serveEcho(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			_, _ = io.Copy(c, c)
		}()
	}
}

// probeOnce is one SOCKS5 CONNECT through the node to target and a byte echoed.
func probeOnce(socks string, target netip.AddrPort) error {
	c, err := net.DialTimeout("tcp", socks, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	ip := target.Addr().As4()
	req := append([]byte{5, 1, 0, 5, 1, 0, 1}, ip[:]...)
	req = append(req, byte(target.Port()>>8), byte(target.Port()))
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

// window is what the probes of one kind started in [from, to) saw: the slowest (an answer
// the node refused counts: it looked the connection up too) and the 99th percentile (a
// window of 2,000 probes is likelier to catch the machine's own noise than one of 20), how
// many ran and how many failed.
type window struct {
	worst, p99 time.Duration
	n, failed  int
	lastErr    error
}

func (w window) String() string {
	if w.n == 0 {
		return "-"
	}
	s := fmt.Sprintf("%v (p99 %v, %d", w.worst.Round(100*time.Microsecond), w.p99.Round(100*time.Microsecond), w.n)
	if w.failed > 0 {
		s += fmt.Sprintf(", %d failed", w.failed)
	}
	return s + ")"
}

func (p *probe) window(kind string, from, to time.Time) window {
	p.mu.Lock()
	defer p.mu.Unlock()
	var w window
	var ds []time.Duration
	for _, s := range p.samples {
		if s.kind != kind || s.at.Before(from) || !s.at.Before(to) {
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
		slices.Sort(ds)
		w.worst, w.p99 = ds[len(ds)-1], ds[len(ds)*99/100]
	}
	return w
}
