package netnstest

import (
	"io"
	"net"
	"strings"
	"testing"
)

// Two namespaces joined by a veth pair: a listener made inside one is reachable from the
// other over the veth addresses.
func TestLinkAndDo(t *testing.T) {
	Require(t)
	a, b := New(t, "a"), New(t, "b")
	Link(t, a, "10.250.0.1/24", b, "10.250.0.2/24")

	var ln net.Listener
	if err := b.Do(func() (err error) {
		ln, err = net.Listen("tcp", "10.250.0.2:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.WriteString(c, "hello from b")
	}()

	var got []byte
	if err := a.Do(func() error {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		got, err = io.ReadAll(c)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if string(got) != "hello from b" {
		t.Fatalf("got %q; want %q", got, "hello from b")
	}
	if out := a.MustExec(t, "ip", "-o", "addr"); !strings.Contains(out, "10.250.0.1/24") {
		t.Fatalf("namespace a lacks its address:\n%s", out)
	}
}
