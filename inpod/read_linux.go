//go:build linux

package inpod

import (
	"io"
	"net"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/netns"
)

// oobSize has room for a few fds, so that two fds are reported as such; more than fit set
// MSG_CTRUNC, and the kernel closes the rest.
var oobSize = unix.CmsgSpace(4 * 4)

// readRequest reads one packet and returns its request and, for Add only, the netns it
// carried, which the caller then owns. Every fd the packet carried is closed unless it is
// returned. Errors are io.EOF, *badMessage, or the connection's own (deadline, close).
func readRequest(c *net.UnixConn, buf *[maxMessage]byte) (*zdspb.WorkloadRequest, *netns.NetNS, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, nil, err
	}
	oob := make([]byte, oobSize)
	var n, oobn, flags int
	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		n, oobn, flags, _, rerr = unix.Recvmsg(int(fd), buf[:], oob, unix.MSG_CMSG_CLOEXEC)
		return rerr != unix.EAGAIN
	})
	if err == nil {
		err = rerr
	}
	if err != nil {
		return nil, nil, err
	}
	// Take every fd first, so that no error below can leak one.
	fds, ferr := rights(oob[:oobn])
	req, fd, err := parse(buf[:n], flags, fds, ferr)
	if err != nil {
		closeAll(fds)
		return nil, nil, err
	}
	if fd < 0 {
		return req, nil, nil
	}
	ns, err := netns.FromFD(fd) // closes fd on error
	if err != nil {
		return nil, nil, bad("add %s: %v", req.GetAdd().GetUid(), err)
	}
	return req, ns, nil
}

// parse checks one packet: n bytes, the recvmsg flags and the fds that came with it. It
// returns the fd an Add carries (-1 for other requests); on error the caller closes fds.
func parse(b []byte, flags int, fds []int, ferr error) (*zdspb.WorkloadRequest, int, error) {
	switch {
	case len(b) == 0 && len(fds) == 0:
		return nil, -1, io.EOF // a SEQPACKET peer that closed reads as an empty packet
	case flags&unix.MSG_TRUNC != 0:
		return nil, -1, bad("message longer than %d bytes", maxMessage)
	case flags&unix.MSG_CTRUNC != 0:
		return nil, -1, bad("control data truncated (more than %d fds?)", len(fds))
	case ferr != nil:
		return nil, -1, bad("control data: %v", ferr)
	case len(fds) > 1:
		return nil, -1, bad("expected one fd, got %d", len(fds))
	}
	req := new(zdspb.WorkloadRequest)
	if err := proto.Unmarshal(b, req); err != nil {
		return nil, -1, bad("decode: %v", err)
	}
	switch req.Payload.(type) {
	case nil:
		return nil, -1, bad("request without a payload")
	case *zdspb.WorkloadRequest_Add:
		if len(fds) == 0 {
			return nil, -1, bad("add %s without a netns fd", req.GetAdd().GetUid())
		}
		return req, fds[0], nil
	}
	if len(fds) > 0 {
		return nil, -1, bad("unexpected fd with %T", req.Payload)
	}
	return req, -1, nil
}

// rights returns every fd in SCM_RIGHTS messages of oob.
func rights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return fds, err
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
