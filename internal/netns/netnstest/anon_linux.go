//go:build linux

package netnstest

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/internal/netns"
)

// NewAnonymous creates an unnamed namespace with loopback up, for tests that need a pod's
// netns without `ip`: it lives as long as some fd refers to it, and t's cleanup closes the
// returned one. It skips t without root.
func NewAnonymous(t testing.TB) *netns.NetNS {
	t.Helper()
	RequireRoot(t)
	// Do on the process's own namespace runs fn on a locked thread and moves that thread
	// back there afterwards, so the unshare leaves no thread of the process behind.
	self, err := netns.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatalf("netns: new anonymous namespace: %v", err)
	}
	defer self.Close()
	fd := -1
	err = self.Do(func() (err error) {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("unshare: %w", err)
		}
		if fd, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			return err
		}
		return loopbackUp()
	})
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		t.Fatalf("netns: new anonymous namespace: %v", err)
	}
	n, err := netns.FromFD(fd)
	if err != nil {
		t.Fatalf("netns: new anonymous namespace: %v", err)
	}
	t.Cleanup(func() { n.Close() })
	return n
}

// loopbackUp sets IFF_UP on lo in the calling thread's namespace.
func loopbackUp() error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("netns: get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("netns: set lo up: %w", err)
	}
	return nil
}
