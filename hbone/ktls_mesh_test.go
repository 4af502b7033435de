//go:build linux

package hbone

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"unsafe"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/ktls"
	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// The kernel TLS mesh: three nodes, two on kernel TLS where the kernel has it and one
// on crypto/tls, each a Server relaying CONNECT streams to TCP backends and a Pool
// relaying TCP connections, all dialing each other, plus x/net/http2 peers on both
// sides. It runs on any host (all user space where the kernel has no TLS) and is the
// heart of `make test-ktls`.

// meshNode is one node: its Server relays each CONNECT to the backend registered for
// its authority.
type meshNode struct {
	name   string
	kernel bool // asks for kernel TLS (it gets it where the kernel has it)
	env    *env

	mu       sync.Mutex
	backends map[string]*net.TCPConn // authority → the relay's end of the backend
	served   map[string]chan meshServed
	ready    map[string]chan struct{} // closed once the relay delivers to the backend
}

type meshServed struct {
	in, out    int64 // relayed to and from the stream
	kernel     bool
	bytes      KernelTLSBytes // counted on the connection during the relay
	err        error
	streamConn *conn
}

func newMeshNode(t *testing.T, name string, kernel bool) *meshNode {
	n := &meshNode{name: name, kernel: kernel, backends: map[string]*net.TCPConn{},
		served: map[string]chan meshServed{}, ready: map[string]chan struct{}{}}
	n.env = newEnv(t, ServerConfig{Config: Config{DisableKernelTLS: !kernel}}, n.handle)
	return n
}

// backend registers authority's backend: the test gets the other end.
func (n *meshNode) backend(t *testing.T, authority string) (far *net.TCPConn, served <-chan meshServed, ready <-chan struct{}) {
	near, far := tcpPair(t)
	ch, rd := make(chan meshServed, 1), make(chan struct{})
	n.mu.Lock()
	n.backends[authority], n.served[authority], n.ready[authority] = near, ch, rd
	n.mu.Unlock()
	return far, ch, rd
}

func (n *meshNode) handle(r *Request) {
	n.mu.Lock()
	tc, ch, rd := n.backends[r.Authority], n.served[r.Authority], n.ready[r.Authority]
	delete(n.backends, r.Authority)
	n.mu.Unlock()
	if tc == nil {
		r.Reject(http.StatusServiceUnavailable)
		return
	}
	st, err := r.Accept(nil)
	if err != nil {
		ch <- meshServed{err: err}
		return
	}
	defer st.Close()
	before := st.KernelTLSBytes()
	in, out, err := relayReady(st, tc, func() { close(rd) })
	ch <- meshServed{in: in, out: out, kernel: st.KernelTLS(), bytes: sub(st.KernelTLSBytes(), before), err: err, streamConn: st.c}
}

func sub(a, b KernelTLSBytes) KernelTLSBytes {
	return KernelTLSBytes{a.SplicedOut - b.SplicedOut, a.CopiedOut - b.CopiedOut, a.SplicedIn - b.SplicedIn, a.CopiedIn - b.CopiedIn}
}

func (n *meshNode) keyFor(to netip.AddrPort) Key {
	return NewKey(identity.MustParse(clientID), []identity.ID{identity.MustParse(serverID)}, to, netip.Addr{})
}

// gatedHashed is sendHashed once gate is closed: a payload that arrives before the
// receiving relay delivers to its socket is queued (copied), which is right but would
// blur the zero-copy count.
func gatedHashed(c *net.TCPConn, seed byte, size int, gate <-chan struct{}) <-chan [32]byte {
	out := make(chan [32]byte, 1)
	go func() {
		<-gate
		out <- <-sendHashed(c, seed, size)
	}()
	return out
}

// meshTransfer is one proxied connection from node from to node to: up bytes from the
// client application, down bytes from the backend, each side half-closing when done.
// It checks hashes and counts and, where both ends run kernel TLS, that every payload
// byte was spliced.
func meshTransfer(t *testing.T, from, to *meshNode, seed byte, up, down int) {
	t.Helper()
	authority := fmt.Sprintf("10.0.%d.%d:80", seed, len(from.name)+len(to.name))
	hB, served, srvReady := to.backend(t, authority)
	cA, cB := tcpPair(t)
	roomy := bigSendBuffer(t, cA, down)
	to.mu.Lock()
	roomy = bigSendBuffer(t, to.backends[authority], up) && roomy
	to.mu.Unlock()
	s, err := from.env.pool.Dial(context.Background(), from.keyFor(to.env.addr), authority, nil)
	if err != nil {
		t.Fatalf("%s → %s: %v", from.name, to.name, err)
	}
	defer s.Close()
	before := s.KernelTLSBytes()
	cliReady := make(chan struct{})
	upSent, downGot := gatedHashed(cB, seed, up, srvReady), recvHashed(cB)
	downSent, upGot := gatedHashed(hB, seed+100, down, cliReady), recvHashed(hB)
	toStream, fromStream, err := relayReady(s, cA, func() { close(cliReady) })
	if err != nil {
		t.Fatalf("%s → %s: client relay: %v", from.name, to.name, err)
	}
	cb := sub(s.KernelTLSBytes(), before)
	r := <-served
	if r.err != nil {
		t.Fatalf("%s → %s: server relay: %v", from.name, to.name, r.err)
	}
	if a, b := <-upSent, <-upGot; a != b {
		t.Errorf("%s → %s: upstream hashes differ", from.name, to.name)
	}
	if a, b := <-downSent, <-downGot; a != b {
		t.Errorf("%s → %s: downstream hashes differ", from.name, to.name)
	}
	if toStream != int64(up) || fromStream != int64(down) || r.in != int64(down) || r.out != int64(up) {
		t.Errorf("%s → %s: relays moved %d/%d and %d/%d; want %d/%d", from.name, to.name, toStream, fromStream, r.out, r.in, up, down)
	}
	kernel := kernelHasTLS(t)
	if s.KernelTLS() != (from.kernel && kernel) || r.kernel != (to.kernel && kernel) {
		t.Errorf("%s → %s: kernel TLS client %v, server %v", from.name, to.name, s.KernelTLS(), r.kernel)
	}
	checkZeroCopy(t, from.name+" → "+to.name+" client", s.KernelTLS(), cb, up, down, roomy)
	checkZeroCopy(t, from.name+" → "+to.name+" server", r.kernel, r.bytes, down, up, roomy)
	t.Logf("%s → %s, %d up, %d down: client kernel %v %+v; server kernel %v %+v", from.name, to.name, up, down, s.KernelTLS(), cb, r.kernel, r.bytes)
}

// checkZeroCopy: on kernel TLS every payload byte sent from a socket was spliced, and
// every one received too when the sink could not fill.
func checkZeroCopy(t *testing.T, what string, kernel bool, b KernelTLSBytes, sent, received int, roomy bool) {
	t.Helper()
	if !kernel {
		if b != (KernelTLSBytes{}) {
			t.Errorf("%s: user-space connection counted %+v", what, b)
		}
		return
	}
	if b.SplicedOut != int64(sent) || b.CopiedOut != 0 {
		t.Errorf("%s: sent %d spliced, %d copied; want %d spliced", what, b.SplicedOut, b.CopiedOut, sent)
	}
	if b.SplicedIn+b.CopiedIn != int64(received) || roomy && b.CopiedIn != 0 {
		t.Errorf("%s: received %d spliced, %d copied; want %d spliced", what, b.SplicedIn, b.CopiedIn, received)
	}
}

// TestKernelTLSMesh: every node to every other, large payloads each way, the client
// half-closing first on one connection and the backend first on the next.
func TestKernelTLSMesh(t *testing.T) {
	leaktest.Check(t)
	kernel := kernelHasTLS(t)
	nodes := []*meshNode{newMeshNode(t, "a", true), newMeshNode(t, "b", true), newMeshNode(t, "c", false)}
	seed := byte(0)
	for _, from := range nodes {
		for _, to := range nodes {
			if from == to {
				continue
			}
			t.Run(from.name+"-"+to.name, func(t *testing.T) {
				seed++
				meshTransfer(t, from, to, seed, 1<<20+1, 64<<10+3) // the client's side ends first
				seed++
				meshTransfer(t, from, to, seed, 32<<10+5, 1<<20+7) // the backend's side ends first
			})
		}
	}
	if !kernel {
		t.Log("no kernel TLS here: every connection ran in user space")
	}
}

// xnetEchoServer is x/net/http2's Server over crypto/tls, answering CONNECT by echoing
// the request body, offering the ALPN protocols protos: "h2" as an x/net server (Istio's
// Go HBONE) does, or NextProtoNoKeyUpdate first, which brings gozt's side to kernel TLS
// (x/net's Server does not look at the protocol; it never sends a KeyUpdate either).
func xnetEchoServer(t *testing.T, protos ...string) netip.AddrPort {
	testCA()
	cfg := srvTLS.Clone()
	cfg.NextProtos = protos
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		echoBody(w, r)
	})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var raws []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		var cwg sync.WaitGroup
		defer cwg.Wait()
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			raws = append(raws, raw)
			mu.Unlock()
			cwg.Add(1)
			go func() {
				defer cwg.Done()
				defer raw.Close()
				tc := tls.Server(raw, cfg)
				if tc.Handshake() != nil {
					return
				}
				(&http2.Server{}).ServeConn(tc, &http2.ServeConnOpts{Handler: h})
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range raws {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return netip.MustParseAddrPort(ln.Addr().String())
}

// TestKernelTLSWithXNetPeers: nodes on kernel TLS and on crypto/tls dial an x/net/http2
// server, and an x/net/http2 Transport dials them. Peers that speak "h2", not
// NextProtoNoKeyUpdate, stay in user-space TLS, which follows the KeyUpdates such a peer
// may send; the x/net server offering NextProtoNoKeyUpdate shows kernel TLS framing
// against x/net's HTTP/2.
func TestKernelTLSWithXNetPeers(t *testing.T) {
	leaktest.Check(t)
	xs, xsKeeps := xnetEchoServer(t, "h2"), xnetEchoServer(t, NextProtoNoKeyUpdate, "h2")
	for _, n := range []*meshNode{newMeshNode(t, "a", true), newMeshNode(t, "c", false)} {
		t.Run(n.name+"-to-xnet-keeping-keys", func(t *testing.T) {
			const size = 64<<10 + 13
			s, err := n.env.pool.Dial(context.Background(), n.keyFor(xsKeeps), "10.9.9.9:80", nil)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			cA, cB := tcpPair(t)
			got := recvHashed(cB)
			ready := make(chan struct{})
			sent := gatedHashed(cB, 5, size, ready)
			if up, down, err := relayReady(s, cA, func() { close(ready) }); err != nil || up != size || down != size {
				t.Fatalf("relay: %d up, %d down, %v; want %d each way", up, down, err, size)
			}
			if a, b := <-sent, <-got; a != b {
				t.Error("echo hashes differ")
			}
			if s.KernelTLS() != (n.kernel && kernelHasTLS(t)) {
				t.Errorf("KernelTLS() = %v", s.KernelTLS())
			}
		})
		t.Run(n.name+"-to-xnet", func(t *testing.T) {
			const size = 1<<20 + 13
			s, err := n.env.pool.Dial(context.Background(), n.keyFor(xs), "10.9.9.9:80", nil)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			before := s.KernelTLSBytes()
			cA, cB := tcpPair(t)
			roomy := bigSendBuffer(t, cA, size)
			got := recvHashed(cB)
			ready := make(chan struct{})
			sent := gatedHashed(cB, 7, size, ready)
			up, down, err := relayReady(s, cA, func() { close(ready) })
			if err != nil || up != size || down != size {
				t.Fatalf("relay: %d up, %d down, %v; want %d each way", up, down, err, size)
			}
			if a, b := <-sent, <-got; a != b {
				t.Error("echo hashes differ")
			}
			b := sub(s.KernelTLSBytes(), before)
			if s.KernelTLS() {
				t.Errorf("KernelTLS() = true with an h2-only peer")
			}
			checkZeroCopy(t, n.name+" to x/net", s.KernelTLS(), b, size, size, roomy)
			t.Logf("kernel %v %+v", s.KernelTLS(), b)
		})
		t.Run("xnet-to-"+n.name, func(t *testing.T) {
			const up, down = 1<<20 + 17, 512<<10 + 19
			hB, served, _ := n.backend(t, "10.8.8.8:80")
			tr := &http2.Transport{TLSClientConfig: xnetTLS()}
			defer tr.CloseIdleConnections()
			pr, pw := io.Pipe()
			req, _ := http.NewRequest("CONNECT", "https://"+n.env.addr.String(), pr)
			req.Host = "10.8.8.8:80"
			res, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			if res.StatusCode != http.StatusOK {
				t.Fatalf("CONNECT: %d", res.StatusCode)
			}
			upSent := make(chan [32]byte, 1)
			go func() {
				h := sha256.New()
				buf := make([]byte, 40000)
				for left := up; left > 0; {
					k := min(left, len(buf))
					for i := range buf[:k] {
						buf[i] = byte(left * i)
					}
					h.Write(buf[:k])
					pw.Write(buf[:k])
					left -= k
				}
				pw.Close() // END_STREAM: x/net's half-close
				var sum [32]byte
				copy(sum[:], h.Sum(nil))
				upSent <- sum
			}()
			upGot, downSent := recvHashed(hB), sendHashed(hB, 9, down)
			h := sha256.New()
			if n, err := io.Copy(h, res.Body); err != nil || n != down {
				t.Fatalf("x/net read %d of %d bytes: %v", n, down, err)
			}
			var downGot [32]byte
			copy(downGot[:], h.Sum(nil))
			if a, b := <-upSent, <-upGot; a != b {
				t.Error("upstream hashes differ")
			}
			if <-downSent != downGot {
				t.Error("downstream hashes differ")
			}
			r := <-served
			if r.err != nil {
				t.Fatal(r.err)
			}
			if r.kernel {
				t.Errorf("server stream KernelTLS() = true with an h2-only peer")
			}
			if r.kernel && (r.bytes.SplicedOut != down || r.bytes.CopiedOut != 0) {
				t.Errorf("server sent %+v; want %d spliced", r.bytes, down)
			}
		})
	}
}

// TestKernelTLSAborts: a stream aborted mid-transfer from either end (RST_STREAM from
// the client, a TCP reset from the backend) ends both relays and leaves the connection
// whole for the next stream.
func TestKernelTLSAborts(t *testing.T) {
	leaktest.Check(t)
	a, b := newMeshNode(t, "a", true), newMeshNode(t, "b", true)
	t.Run("client resets", func(t *testing.T) {
		hB, served, _ := b.backend(t, "10.7.0.1:80")
		s, err := a.env.pool.Dial(context.Background(), a.keyFor(b.env.addr), "10.7.0.1:80", nil)
		if err != nil {
			t.Fatal(err)
		}
		sendHashed(hB, 1, 8<<20) // more than the windows: it is still sending at the reset
		buf := make([]byte, 100<<10)
		if _, err := io.ReadFull(s, buf); err != nil {
			t.Fatal(err)
		}
		s.Close()
		if r := <-served; r.err == nil {
			t.Error("the server's relay ended cleanly after the client's reset")
		}
	})
	t.Run("backend resets", func(t *testing.T) {
		hB, served, ready := b.backend(t, "10.7.0.2:80")
		s, err := a.env.pool.Dial(context.Background(), a.keyFor(b.env.addr), "10.7.0.2:80", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		cA, cB := tcpPair(t)
		go io.Copy(io.Discard, cB)
		sendHashed(cB, 2, 8<<20)
		relayed := make(chan error, 1)
		go func() { _, _, err := relay(s, cA); relayed <- err }()
		<-ready
		buf := make([]byte, 100<<10)
		if _, err := io.ReadFull(hB, buf); err != nil {
			t.Fatal(err)
		}
		hB.SetLinger(0)
		hB.Close()
		if err := <-relayed; err == nil {
			t.Error("the client's relay ended cleanly after the backend's reset")
		}
		<-served
	})
	// The connection that carried both aborts carries the next stream.
	meshTransfer(t, a, b, 3, 256<<10, 256<<10)
	if n := b.env.serverConns(); n != 1 {
		t.Errorf("%d connections from a to b; want the one to survive the aborts", n)
	}
}

// TestKernelTLSKeyUpdate: a node on kernel TLS asks its x/net peer (crypto/tls) for a
// KeyUpdate, which the kernel cannot follow: the connection ends, its open stream fails
// rather than reading garbage, and the pool dials a new connection for the next stream.
func TestKernelTLSKeyUpdate(t *testing.T) {
	leaktest.Check(t)
	if !kernelHasTLS(t) {
		t.Skip("no kernel TLS here: run `make test-ktls`")
	}
	xs := xnetEchoServer(t, NextProtoNoKeyUpdate, "h2") // a Go peer: it rekeys only when asked
	var infos tlsInfos
	n := newMeshNode(t, "a", true)
	n.env.pool.cfg.OnTLS = infos.add
	k := n.keyFor(xs)
	s, err := n.env.pool.Dial(context.Background(), k, "10.9.9.9:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 6)
	if _, err := io.ReadFull(s, buf); err != nil || string(buf) != "before" {
		t.Fatalf("echo %q, %v", buf, err)
	}
	c := s.c
	requestKeyUpdate(t, c)
	_, err = io.ReadAll(s)
	if !errors.Is(err, ktls.ErrKeyUpdate) || !errors.Is(err, ErrConnClosed) {
		t.Fatalf("stream read after the peer's KeyUpdate: %v; want ErrConnClosed for ktls.ErrKeyUpdate", err)
	}
	s2, err := n.env.pool.Dial(context.Background(), k, "10.9.9.9:80", nil)
	if err != nil {
		t.Fatalf("Dial after the KeyUpdate: %v", err)
	}
	defer s2.Close()
	if s2.c == c {
		t.Fatal("the pool reused the connection the KeyUpdate ended")
	}
	hashEcho(t, s2, 8, 300<<10)
	if got := infos.take(); len(got) != 2 || !got[0].Kernel || !got[1].Kernel {
		t.Errorf("OnTLS heard %+v; want two kernel TLS connections", got)
	}
}

// requestKeyUpdate sends a KeyUpdate(update_requested) handshake record on c's kernel
// TLS socket, between frames: crypto/tls answers it with its own KeyUpdate.
func requestKeyUpdate(t *testing.T, c *conn) {
	t.Helper()
	c.lockWrite()
	defer c.unlockWrite()
	if err := c.bc.Flush(); err != nil {
		t.Fatal(err)
	}
	oob := make([]byte, unix.CmsgSpace(1))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level, h.Type = unix.SOL_TLS, 1 // TLS_SET_RECORD_TYPE
	h.SetLen(unix.CmsgLen(1))
	oob[unix.CmsgLen(0)] = 22     // handshake
	msg := []byte{24, 0, 0, 1, 1} // KeyUpdate, length 1, update_requested
	rc, err := c.kt.conn.NetConn().SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := rc.Write(func(fd uintptr) bool {
		_, serr = unix.SendmsgN(int(fd), msg, oob, nil, 0)
		return serr != unix.EAGAIN
	}); err != nil || serr != nil {
		t.Fatalf("sendmsg: %v %v", err, serr)
	}
}
