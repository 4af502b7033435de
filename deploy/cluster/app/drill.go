package main

// The failure drills' workloads (deploy/clustertest/drills_test.go, issue 55): a server that
// answers each connection with who it is and a hash of what it was sent, and a load that
// runs for the pod's life and reports, a line a second on stdout, what it tried and how each
// failure looked. The test reads the lines back with kubectl logs, so the counts survive
// anything a drill does to kubectl exec (a node cut off, a ztunnel killed).

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

// drillServe: app drillserve -who SERVICE/POD [-echo :8080] [-hash :8081] [-grace D]. The echo
// port echoes every byte (the long-lived streams); the hash port reads one line and answers
// "WHO SHA256(line)\n", then closes (the new connections: a wrong workload or a wrong byte
// shows). On SIGTERM it goes on accepting for -grace (an application that waits for its
// endpoint to be removed, as Kubernetes advises), then stops; -grace 0 exits at once, as an
// application with no graceful stop does.
func drillServe(args []string) error {
	fs := flag.NewFlagSet("drillserve", flag.ExitOnError)
	echoAddr := fs.String("echo", ":8080", "echo listener")
	hashAddr := fs.String("hash", ":8081", "hash listener")
	who := fs.String("who", "", "what the hash answer names: SERVICE/POD")
	grace := fs.Duration("grace", 0, "after SIGTERM, go on accepting this long")
	fs.Parse(args)
	if *who == "" {
		return errors.New("drillserve: -who is required")
	}
	el, err := net.Listen("tcp", *echoAddr)
	if err != nil {
		return err
	}
	hl, err := net.Listen("tcp", *hashAddr)
	if err != nil {
		return err
	}
	go acceptLoop(el, echoConn)
	go acceptLoop(hl, func(c net.Conn) { hashConn(c, *who) })
	fmt.Println("serving", el.Addr(), hl.Addr(), "as", *who)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	fmt.Println("SIGTERM: accepting for", *grace)
	time.Sleep(*grace)
	return nil // exiting ends every connection, as the pod's end does
}

func acceptLoop(ln net.Listener, serve func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go serve(c)
	}
}

func hashConn(c net.Conn, who string) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(15 * time.Second))
	line, err := bufio.NewReader(io.LimitReader(c, 1024)).ReadString('\n')
	if err != nil {
		return
	}
	sum := sha256.Sum256([]byte(line))
	fmt.Fprintf(c, "%s %x\n", who, sum)
}

// loadStats is what app load counts between two report lines. The mutex guards every field.
type loadStats struct {
	mu        sync.Mutex
	conns     map[string]map[string]int // target -> outcome (ok, dns, refused, reset, closed, timeout, wrong, other) -> count
	connMs    map[string][]int          // time to the answer of each successful connection, by target
	lookups   map[string]int            // ok, timeout, servfail, nxdomain, empty, other
	lookupMs  []int
	broken    int // long-lived streams that ended with an error after carrying bytes
	redials   int // long-lived streams that could not be (re)opened
	streamsUp int
	events    []loadEvent // failures, at most maxEvents a second
}

const maxEvents = 20

// loadEvent is one failure: a connection, a lookup or a stream.
type loadEvent struct {
	T      time.Time `json:"t"`
	What   string    `json:"what"` // conn, lookup, stream, redial
	Target string    `json:"target"`
	Kind   string    `json:"kind"`
	Err    string    `json:"err"`
}

// loadLine is one report line: a second's counts, and the failures in it.
type loadLine struct {
	T         time.Time                 `json:"t"`
	Conns     map[string]map[string]int `json:"conns"`
	ConnMs    map[string][]int          `json:"connMs"`
	Lookups   map[string]int            `json:"lookups"`
	LookupMs  []int                     `json:"lookupMs"`
	Broken    int                       `json:"broken"`
	Redials   int                       `json:"redials"`
	StreamsUp int                       `json:"streamsUp"`
	Events    []loadEvent               `json:"events,omitempty"`
}

func (s *loadStats) fail(what, target, kind string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.events) < maxEvents {
		s.events = append(s.events, loadEvent{time.Now().UTC(), what, target, kind, fmt.Sprint(err)})
	}
}

// flush returns the counts since the last flush and starts new ones.
func (s *loadStats) flush(now time.Time) loadLine {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := loadLine{T: now.UTC(), Conns: s.conns, ConnMs: s.connMs, Lookups: s.lookups, LookupMs: s.lookupMs,
		Broken: s.broken, Redials: s.redials, StreamsUp: s.streamsUp, Events: s.events}
	s.conns, s.lookups, s.connMs, s.lookupMs, s.events = map[string]map[string]int{}, map[string]int{}, map[string][]int{}, nil, nil
	s.broken, s.redials = 0, 0
	return l
}

// drillLoad: app load -conn A,B -rate 20 -dns N1,N2 -dns-rate 40 -stream ADDR -streams 4.
// Targets may say {other}: the node that is not NODE_NAME among -nodes (a client reaches the
// service pinned to the other node). It runs until SIGTERM and prints a loadLine a second.
func drillLoad(args []string) error {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	conns := fs.String("conn", "", "comma-separated HOST:PORT of hash servers, taken in turn")
	rate := fs.Int("rate", 20, "new connections a second")
	names := fs.String("dns", "", "comma-separated names looked up in turn, A and AAAA alternately")
	dnsRate := fs.Int("dns-rate", 40, "lookups a second, each on a new socket, failed after 1 s without an answer")
	streamAddr := fs.String("stream", "", "HOST:PORT of an echo server for the long-lived streams")
	streams := fs.Int("streams", 4, "long-lived streams, each echoing 16 bytes every 100 ms")
	nodes := fs.String("nodes", "node1,node2", "the nodes, for {other}")
	fs.Parse(args)
	other := ""
	for _, n := range strings.Split(*nodes, ",") {
		if n != os.Getenv("NODE_NAME") {
			other = n
		}
	}
	expand := func(s string) []string {
		if s == "" {
			return nil
		}
		return strings.Split(strings.ReplaceAll(s, "{other}", other), ",")
	}
	connTargets, nameTargets := expand(*conns), expand(*names)
	server, err := resolvConfServer()
	if err != nil && len(nameTargets) > 0 {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	s := &loadStats{conns: map[string]map[string]int{}, lookups: map[string]int{}, connMs: map[string][]int{}}
	var wg sync.WaitGroup
	every := func(perSecond int, f func(i int)) {
		if perSecond <= 0 {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(time.Second / time.Duration(perSecond))
			defer t.Stop()
			for i := 0; ; i++ {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				wg.Add(1)
				go func() { defer wg.Done(); f(i) }()
			}
		}()
	}
	if len(connTargets) > 0 {
		every(*rate, func(i int) { hashRequest(s, connTargets[i%len(connTargets)]) })
	}
	if len(nameTargets) > 0 {
		every(*dnsRate, func(i int) {
			qtype := dns.TypeA
			if i%2 == 1 {
				qtype = dns.TypeAAAA
			}
			lookup(s, server, nameTargets[(i/2)%len(nameTargets)], qtype)
		})
	}
	if *streamAddr != "" {
		for _, addr := range expand(*streamAddr) {
			for range *streams {
				wg.Add(1)
				go func() { defer wg.Done(); longStream(ctx, s, addr) }()
			}
		}
	}
	enc := json.NewEncoder(os.Stdout)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return enc.Encode(s.flush(time.Now()))
		case now := <-tick.C:
			if err := enc.Encode(s.flush(now)); err != nil {
				return err
			}
		}
	}
}

// hashRequest is one new connection: a random line sent, "SERVICE/POD HASH" expected back.
func hashRequest(s *loadStats, addr string) {
	start := time.Now()
	kind, err := func() (string, error) {
		c, err := net.DialTimeout("tcp", addr, 15*time.Second)
		var dnsErr *net.DNSError
		if errors.As(err, &dnsErr) {
			return "dns", err // the service's name did not resolve
		}
		if err != nil {
			return classify(err), err
		}
		defer c.Close()
		c.SetDeadline(start.Add(15 * time.Second))
		var b [16]byte
		rand.Read(b[:])
		line := hex.EncodeToString(b[:]) + "\n"
		if _, err := io.WriteString(c, line); err != nil {
			return classify(err), err
		}
		answer, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			if errors.Is(err, io.EOF) && answer == "" {
				return "closed", errors.New("closed without an answer")
			}
			return classify(err), err
		}
		sum := sha256.Sum256([]byte(line))
		who, hash, _ := strings.Cut(strings.TrimSpace(answer), " ")
		service := strings.Split(addr, ".")[0] // server.ns.svc...:8081 -> server
		if hash != hex.EncodeToString(sum[:]) || !strings.HasPrefix(who, service+"/") {
			return "wrong", fmt.Errorf("answer %q from %s", strings.TrimSpace(answer), addr)
		}
		return "ok", nil
	}()
	s.mu.Lock()
	if s.conns[addr] == nil {
		s.conns[addr] = map[string]int{}
	}
	s.conns[addr][kind]++
	if kind == "ok" {
		s.connMs[addr] = append(s.connMs[addr], int(time.Since(start).Milliseconds()))
	}
	s.mu.Unlock()
	if kind != "ok" {
		s.fail("conn", addr, kind, err)
	}
}

// classify names a connection's failure as the table counts it.
func classify(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return "reset"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "closed"
	}
	return "other"
}

// resolvConfServer is the pod's first nameserver (istio-cni captures it to the ztunnel's DNS
// proxy), as HOST:53.
func resolvConfServer() (string, error) {
	cc, err := dns.ClientConfigFromFile("/etc/resolv.conf")
	if err != nil {
		return "", err
	}
	if len(cc.Servers) == 0 {
		return "", errors.New("no nameserver in /etc/resolv.conf")
	}
	return net.JoinHostPort(cc.Servers[0], cc.Port), nil
}

// lookup asks server for name's qtype on a new UDP socket, once, and gives it 1 s: a query
// dropped anywhere is a failure, not a slow retry. A mesh service must have an A record (the
// cluster is IPv4: AAAA may be empty).
func lookup(s *loadStats, server, name string, qtype uint16) {
	start := time.Now()
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	c := dns.Client{Net: "udp", Timeout: time.Second}
	r, _, err := c.Exchange(m, server)
	kind := "ok"
	switch {
	case err != nil:
		kind = classify(err)
	case r.Rcode == dns.RcodeServerFailure:
		kind = "servfail"
	case r.Rcode == dns.RcodeNameError:
		kind = "nxdomain"
	case r.Rcode != dns.RcodeSuccess:
		kind = "other"
		err = fmt.Errorf("rcode %s", dns.RcodeToString[r.Rcode])
	case qtype == dns.TypeA && len(r.Answer) == 0:
		kind = "empty"
	}
	s.mu.Lock()
	s.lookups[kind]++
	if kind == "ok" {
		s.lookupMs = append(s.lookupMs, int(time.Since(start).Milliseconds()))
	}
	s.mu.Unlock()
	if kind != "ok" {
		if err == nil {
			err = fmt.Errorf("%s %s: %s", name, dns.TypeToString[qtype], kind)
		}
		s.fail("lookup", name+" "+dns.TypeToString[qtype], kind, err)
	}
}

// longStream keeps one connection echoing 16 bytes every 100 ms until ctx ends; a broken one
// is counted and dialed again after 100 ms.
func longStream(ctx context.Context, s *loadStats, addr string) {
	for ctx.Err() == nil {
		carried, err := echoEvery(ctx, s, addr)
		if err == nil {
			return
		}
		s.mu.Lock()
		what := "redial"
		if carried {
			what = "stream"
			s.broken++
		} else {
			s.redials++
		}
		s.mu.Unlock()
		s.fail(what, addr, classify(err), err)
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// echoEvery runs one long-lived stream; it reports whether the stream carried a byte.
func echoEvery(ctx context.Context, s *loadStats, addr string) (carried bool, err error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return false, err
	}
	defer c.Close()
	up := false
	defer func() {
		if up {
			s.mu.Lock()
			s.streamsUp--
			s.mu.Unlock()
		}
	}()
	buf, got := make([]byte, 16), make([]byte, 16)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for i := 0; ; i++ {
		for j := range buf {
			buf[j] = byte(i + j)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(buf); err != nil {
			return carried, fmt.Errorf("write: %w", err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			return carried, fmt.Errorf("read: %w", err)
		}
		if string(got) != string(buf) {
			return carried, errors.New("corrupt echo")
		}
		if !up {
			up, carried = true, true
			s.mu.Lock()
			s.streamsUp++
			s.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return carried, nil
		case <-t.C:
		}
	}
}

// stall opens n connections to addr, each sending one TLS ClientHello and nothing after it,
// and holds them (a dropped one is dialed again) until SIGTERM: handshakes that never finish.
func stall(addr string, n int) error {
	hello, err := clientHello()
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var mu sync.Mutex
	open, dropped := 0, 0
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				c, err := net.DialTimeout("tcp", addr, 5*time.Second)
				if err == nil {
					_, err = c.Write(hello)
				}
				if err == nil {
					mu.Lock()
					open++
					mu.Unlock()
					// Hold it: read nothing until it ends or we stop.
					go func() { <-ctx.Done(); c.Close() }()
					io.Copy(io.Discard, c)
					mu.Lock()
					open--
					dropped++
					mu.Unlock()
				}
				if c != nil {
					c.Close()
				}
				select {
				case <-ctx.Done():
				case <-time.After(100 * time.Millisecond):
				}
			}
		}()
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return nil
		case <-tick.C:
			mu.Lock()
			fmt.Printf("stalled %d dropped %d\n", open, dropped)
			mu.Unlock()
		}
	}
}

// clientHello is the first flight of a TLS 1.3 client as crypto/tls writes it.
func clientHello() ([]byte, error) {
	c := &firstWrite{}
	tls.Client(c, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}}).Handshake()
	if len(c.b) == 0 {
		return nil, errors.New("stall: no ClientHello written")
	}
	return c.b, nil
}

// firstWrite is a net.Conn that keeps what is written to it and fails every read, so a TLS
// handshake over it writes its ClientHello and stops.
type firstWrite struct {
	net.Conn
	b []byte
}

func (c *firstWrite) Write(p []byte) (int, error) { c.b = append(c.b, p...); return len(p), nil }
func (c *firstWrite) Read([]byte) (int, error)    { return 0, io.EOF }
func (c *firstWrite) Close() error                { return nil }
func (c *firstWrite) SetDeadline(time.Time) error { return nil }
