package proxy

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// USER_TIMEOUT_ENABLED: proxied sockets get TCP_USER_TIMEOUT; without it they keep the
// kernel's default (0).
func TestTuneSocketUserTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, ut := range []time.Duration{0, 1710 * time.Second} {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		p := &Proxy{cfg: Config{UserTimeout: ut, KeepaliveTime: time.Minute, KeepaliveInterval: time.Second, KeepaliveRetries: 3}}
		p.cfg.setDefaults()
		p.log = p.cfg.Logger
		p.tuneSocket(c.(*net.TCPConn))
		rc, _ := c.(*net.TCPConn).SyscallConn()
		var got int
		rc.Control(func(fd uintptr) { got, err = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT) })
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		if time.Duration(got)*time.Millisecond != ut {
			t.Errorf("UserTimeout %v: TCP_USER_TIMEOUT = %d ms", ut, got)
		}
	}
}
