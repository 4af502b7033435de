package main

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/netns/netnstest"
)

// checkResetsInPod: in in-pod mode (pod A's 15001, HBONE, pod B's 15008), a reset at
// either end reaches the other end as a reset (RST_STREAM(CONNECT_ERROR) between the
// proxies), and a connection pod B's policy denies is reset by pod A's proxy rather than
// closed with a FIN. From outside the mesh (the node's namespace: plain TCP captured on
// pod B's 15006, TCP to the app) a reset crosses the one proxy the same way, and a denied
// connection is reset by pod B's.
func checkResetsInPod(t *testing.T, clientPod, outside, serverPod *netnstest.NS, serverIP, port, deniedPort string) {
	t.Helper()
	t.Run("over HBONE", func(t *testing.T) { checkResets(t, clientPod, serverPod, serverIP, port, deniedPort) })
	t.Run("plaintext from outside the mesh", func(t *testing.T) { checkResets(t, outside, serverPod, serverIP, port, deniedPort) })
}

func checkResets(t *testing.T, clientPod, serverPod *netnstest.NS, serverIP, port, deniedPort string) {
	t.Helper()
	var ln net.Listener
	if err := serverPod.Do(func() (err error) {
		ln, err = net.Listen("tcp", net.JoinHostPort(serverIP, port))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan *net.TCPConn, 2)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c.(*net.TCPConn)
		}
	}()
	open := func() (*net.TCPConn, *net.TCPConn) {
		t.Helper()
		c, err := dialIn(clientPod, "tcp", net.JoinHostPort(serverIP, port))
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(20 * time.Second))
		c.Write([]byte("hello"))
		var b *net.TCPConn
		select {
		case b = <-accepted:
		case <-time.After(20 * time.Second):
			t.Fatal("the server pod never got the connection")
		}
		b.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(b, make([]byte, 5)); err != nil {
			t.Fatal(err)
		}
		b.Write([]byte("hi"))
		if _, err := io.ReadFull(c, make([]byte, 2)); err != nil {
			t.Fatal(err)
		}
		return c.(*net.TCPConn), b
	}
	reset := func(c *net.TCPConn) {
		c.SetLinger(0)
		c.Close()
	}

	c, b := open()
	reset(b)
	if n, err := io.Copy(io.Discard, c); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the server reset: the client read %d more bytes, then %v; want a reset", n, err)
	}
	c.Close()

	c, b = open()
	reset(c)
	if n, err := io.Copy(io.Discard, b); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the client reset: the server read %d more bytes, then %v; want a reset", n, err)
	}
	b.Close()

	d, err := dialIn(clientPod, "tcp", net.JoinHostPort(serverIP, deniedPort))
	if err == nil {
		d.SetDeadline(time.Now().Add(20 * time.Second))
		_, err = io.Copy(io.Discard, d)
		d.Close()
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("a connection to a port the server pod's policy denies: %v; want a reset", err)
	}
}
