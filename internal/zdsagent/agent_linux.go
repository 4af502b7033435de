//go:build linux

package zdsagent

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod/zdspb"
)

// timeout bounds every read and write: istio-cni gives ztunnel 5 s per request.
const timeout = 5 * time.Second

type listener struct{ ln *net.UnixListener }

func listen(path string) (listener, error) {
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	return listener{ln}, err
}

func (l listener) close() error { return l.ln.Close() }

// accept waits for ztunnel and checks its hello, the bare bytes 08 01.
func (l listener) accept() (packetConn, error) {
	for {
		c, err := l.ln.AcceptUnix()
		if err != nil {
			return packetConn{}, err
		}
		pc := packetConn{c}
		hello, err := pc.read()
		if err == nil && !bytes.Equal(hello, []byte{0x08, 0x01}) {
			err = fmt.Errorf("hello % x; want 08 01", hello)
		}
		if err == nil {
			return pc, nil
		}
		c.Close() // not a ztunnel we understand; wait for the next
	}
}

type packetConn struct{ c *net.UnixConn }

func (p packetConn) close() { p.c.Close() }

func (p packetConn) read() ([]byte, error) {
	b := make([]byte, 1024)
	p.c.SetReadDeadline(time.Now().Add(timeout))
	n, err := p.c.Read(b)
	return b[:n], err
}

func (p packetConn) request(req *zdspb.WorkloadRequest, fds []int) (nack string, err error) {
	b, err := proto.Marshal(req)
	if err != nil {
		closeAll(fds)
		return "", err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	p.c.SetWriteDeadline(time.Now().Add(timeout))
	_, _, err = p.c.WriteMsgUnix(b, oob, nil)
	closeAll(fds)
	if err != nil {
		return "", err
	}
	b, err = p.read()
	if err != nil {
		return "", err
	}
	var resp zdspb.WorkloadResponse
	if err := proto.Unmarshal(b, &resp); err != nil {
		return "", err
	}
	if resp.GetAck() == nil {
		return "", errors.New("response without an ack")
	}
	return resp.GetAck().GetError(), nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

func openNetNS(path string) (int, error) {
	return unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
}
