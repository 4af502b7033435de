//go:build linux

package zdsagent

import (
	"bytes"
	"fmt"
	"net"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod/zdspb"
)

// The wire, one packet at a time, as istio-cni's side of the SOCK_SEQPACKET socket sees it.
// Agent is built on these, and so is the scripted agent of package inpodtest, which sends
// whatever a test asks for (bad messages included) and so needs them bare.

// maxResponse is the read buffer: one WorkloadResponse, or ztunnel's hello.
const maxResponse = 2048

// ListenUnix listens on path for ztunnel's connections.
func ListenUnix(path string) (*net.UnixListener, error) {
	return net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
}

// ReadHello reads ztunnel's first packet, waiting at most d, and checks that it is the
// hello, the bare bytes 08 01.
func ReadHello(c *net.UnixConn, d time.Duration) error {
	hello, err := Read(c, d)
	if err == nil && !bytes.Equal(hello, []byte{0x08, 0x01}) {
		err = fmt.Errorf("hello % x; want 08 01", hello)
	}
	return err
}

// Read reads one packet, waiting at most d.
func Read(c *net.UnixConn, d time.Duration) ([]byte, error) {
	b := make([]byte, maxResponse)
	c.SetReadDeadline(time.Now().Add(d))
	n, err := c.Read(b)
	return b[:n], err
}

// Send sends one packet with fds as SCM_RIGHTS, waiting at most d, and closes the sender's
// copies of fds whatever happens.
func Send(c *net.UnixConn, b []byte, fds []int, d time.Duration) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	c.SetWriteDeadline(time.Now().Add(d))
	_, _, err := c.WriteMsgUnix(b, oob, nil)
	closeAll(fds)
	return err
}

// ReadAck reads ztunnel's answer to one request, waiting at most d: "" for an ACK, else the
// NACK's error.
func ReadAck(c *net.UnixConn, d time.Duration) (nack string, err error) {
	b, err := Read(c, d)
	if err != nil {
		return "", err
	}
	var resp zdspb.WorkloadResponse
	if err := proto.Unmarshal(b, &resp); err != nil {
		return "", fmt.Errorf("bad response: %w", err)
	}
	if resp.GetAck() == nil {
		return "", fmt.Errorf("response without an ack: %v", &resp)
	}
	return resp.GetAck().GetError(), nil
}

// Request sends req with fds (see Send) and reads the answer (see ReadAck), waiting at most
// d for each.
func Request(c *net.UnixConn, req *zdspb.WorkloadRequest, fds []int, d time.Duration) (nack string, err error) {
	b, err := proto.Marshal(req)
	if err != nil {
		closeAll(fds)
		return "", err
	}
	if err := Send(c, b, fds, d); err != nil {
		return "", err
	}
	return ReadAck(c, d)
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
