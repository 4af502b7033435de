//go:build linux

package zdsagent

import (
	"net"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/inpod/zdspb"
)

// timeout bounds every read and write: istio-cni gives ztunnel 5 s per request.
const timeout = 5 * time.Second

type listener struct{ ln *net.UnixListener }

func listen(path string) (listener, error) {
	ln, err := ListenUnix(path)
	return listener{ln}, err
}

func (l listener) close() error { return l.ln.Close() }

// accept waits for ztunnel and checks its hello (see ReadHello).
func (l listener) accept() (packetConn, error) {
	for {
		c, err := l.ln.AcceptUnix()
		if err != nil {
			return packetConn{}, err
		}
		if ReadHello(c, timeout) == nil {
			return packetConn{c}, nil
		}
		c.Close() // not a ztunnel we understand; wait for the next
	}
}

type packetConn struct{ c *net.UnixConn }

func (p packetConn) close() { p.c.Close() }

func (p packetConn) request(req *zdspb.WorkloadRequest, fds []int) (nack string, err error) {
	return Request(p.c, req, fds, timeout)
}

func openNetNS(path string) (int, error) {
	return unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
}
