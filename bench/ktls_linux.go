package bench

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// kernelTLSHere returns why the kernel cannot take TLS records (setsockopt TCP_ULP "tls"
// on a loopback connection fails), or nil.
func kernelTLSHere() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		return err
	}
	defer c.Close()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptString(int(fd), unix.SOL_TCP, unix.TCP_ULP, "tls") }); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("setsockopt TCP_ULP tls: %w", serr)
	}
	return nil
}
