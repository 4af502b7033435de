package hbone

import (
	"io"
	"net"
	"reflect"
	"testing"
)

// readerCatcher records the reader io.Copy hands its ReadFrom.
type readerCatcher struct{ r io.Reader }

func (c *readerCatcher) Write(p []byte) (int, error) { return len(p), nil }
func (c *readerCatcher) ReadFrom(r io.Reader) (int64, error) {
	c.r = r
	return 0, nil
}

// pollable matches the net package's io.Copy helper by its type name; this fails when the
// standard library renames it, rather than ReadFrom silently losing its poll path.
func TestPollableMatchesTheNetPackagesCopyHelper(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
		}
	}()
	nc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var rc readerCatcher
	if _, err := io.Copy(&rc, nc); err != nil {
		t.Fatal(err)
	}
	if rc.r == nil {
		t.Fatal("io.Copy from a *net.TCPConn did not call ReadFrom")
	}
	if _, direct := rc.r.(*net.TCPConn); !direct && pollable(rc.r) == nil {
		t.Fatalf("pollable(%s) = nil: the net package's copy helper changed; update pollable", reflect.TypeOf(rc.r))
	}
}
