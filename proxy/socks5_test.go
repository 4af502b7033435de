package proxy_test

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// A client may send its greeting, its request and its first data in one write, or dribble
// the handshake a byte at a time; either way every byte arrives, in order, once.
func TestSocks5PipelinedAndDribbled(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	ip := netip.MustParseAddr(m.serverIP).As4()
	handshake := append([]byte{5, 1, 0, 5, 1, 0, 1}, ip[:]...)
	handshake = binary.BigEndian.AppendUint16(handshake, be.port())
	data := bytes.Repeat([]byte("early bytes behind the request "), 40)

	for _, tc := range []struct {
		name   string
		writes [][]byte
	}{
		{"all in one write", [][]byte{append(append([]byte(nil), handshake...), data...)}},
		{"a byte at a time", split(handshake, 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dialRaw(t, m.a.socks(t))
			for _, w := range tc.writes {
				if _, err := c.Write(w); err != nil {
					t.Fatal(err)
				}
				time.Sleep(time.Millisecond)
			}
			var replies [12]byte // method reply and connect reply
			if _, err := io.ReadFull(c, replies[:]); err != nil {
				t.Fatal(err)
			}
			if replies[0] != 5 || replies[1] != 0 || replies[2] != 5 || replies[3] != 0 {
				t.Fatalf("replies %v; want method 0 and success", replies)
			}
			if len(tc.writes) > 1 { // the dribbling client sends its data after the reply
				if _, err := c.Write(data); err != nil {
					t.Fatal(err)
				}
			}
			c.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(c)
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("echo: %d bytes, %v; want the %d bytes sent", len(got), err, len(data))
			}
		})
	}
}

// dialRaw connects to a SOCKS5 listener for a test that speaks the protocol itself; the
// connection closes when the test ends, and no read or write waits over 10 s.
func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

func split(b []byte, n int) [][]byte {
	var out [][]byte
	for len(b) > n {
		out = append(out, b[:n])
		b = b[n:]
	}
	return append(out, b)
}

// Malformed or unsupported SOCKS5 input gets the RFC 1928 answer for it (or a close when
// there is none) and costs nothing else: the listener goes on serving good clients.
func TestSocks5BadInput(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	ip := netip.MustParseAddr(m.serverIP).As4()
	requestTo := func(port uint16, ver, cmd, atyp byte, addr ...byte) []byte {
		return binary.BigEndian.AppendUint16(append([]byte{ver, cmd, 0, atyp}, addr...), port)
	}
	request := func(ver, cmd, atyp byte, addr ...byte) []byte { return requestTo(be.port(), ver, cmd, atyp, addr...) }
	greet := []byte{5, 1, 0}
	methodOK := []byte{5, 0}
	reply := func(code byte) []byte { return []byte{5, code, 0, 1, 0, 0, 0, 0, 0, 0} }
	refused := append(greet, requestTo(closedPort(t, m.serverIP), 5, 1, 1, ip[:]...)...)

	for _, tc := range []struct {
		name string
		send []byte
		want []byte // all the proxy sends before it closes
	}{
		{"greeting of version 4", []byte{4, 1, 0}, nil},
		{"greeting with no methods", []byte{5, 0}, []byte{5, 0xFF}},
		{"greeting with no methods, request behind it", append([]byte{5, 0}, request(5, 1, 1, ip[:]...)...), []byte{5, 0xFF}},
		{"greeting without no-auth", []byte{5, 2, 1, 2}, []byte{5, 0xFF}},
		{"request of version 4", append(greet, request(4, 1, 1, ip[:]...)...), append(methodOK, reply(1)...)},
		{"BIND", append(greet, request(5, 2, 1, ip[:]...)...), append(methodOK, reply(7)...)},
		{"UDP ASSOCIATE", append(greet, request(5, 3, 1, ip[:]...)...), append(methodOK, reply(7)...)},
		{"address type 5", append(greet, request(5, 1, 5, 1, 2, 3, 4)...), append(methodOK, reply(8)...)},
		// The tunnel fails after the request was read: the reply must still arrive whole.
		{"refused upstream, data behind the request", append(refused, "GET / HTTP/1.1\r\n\r\n"...), append(methodOK, reply(5)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dialRaw(t, m.a.socks(t))
			if _, err := c.Write(tc.send); err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(c)
			if err != nil {
				t.Fatalf("after %d bytes: %v (want the proxy to answer and close)", len(got), err)
			}
			if !bytes.Equal(got, tc.want) {
				t.Fatalf("proxy sent %v, want %v", got, tc.want)
			}
		})
	}
	// And a good client still gets through.
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := pingEcho(c, "after the bad clients"); err != nil {
		t.Fatal(err)
	}
}
