// Package netns enters Linux network namespaces: NetNS is an open namespace (such as the pod
// netns istio-cni hands ztunnel over ZDS) that runs code on a thread switched into it, and
// Sockets is the socket factory built on it (listen and dial inside the namespace, with
// SO_MARK and SO_REUSEPORT) that a per-pod proxy takes. CheckCapabilities tells at start-up
// whether the process may do both.
//
// It does not create namespaces or install redirection rules: that is istio-cni's job
// (internal/cnirules for tests; package netnstest builds namespaces for tests). Elsewhere
// than Linux every operation fails with errors.ErrUnsupported, but for the zero Sockets,
// which opens plain sockets.
//
// The exported API is declared here once; netns_linux.go and netns_other.go add only the
// unexported hooks it calls.
package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
)

// ErrClosed is returned by a NetNS used after Close.
var ErrClosed = errors.New("netns: namespace closed")

// NetNS is an open network namespace (an fd received over SCM_RIGHTS, or a file such as
// /proc/<pid>/ns/net or /var/run/netns/<name>). It is safe for concurrent use.
type NetNS struct {
	id ID

	mu sync.RWMutex // guards fd: held for reading while a thread enters the namespace
	fd int          // -1 after Close
}

// ID identifies a namespace: two fds refer to the same namespace when their IDs are equal.
type ID struct{ Dev, Ino uint64 }

func (id ID) String() string { return fmt.Sprintf("net:[%d] dev %d", id.Ino, id.Dev) }

// FromFD takes ownership of fd, which must be a network namespace; when it is not, FromFD
// closes it and fails.
func FromFD(fd int) (*NetNS, error) {
	id, err := check(fd)
	if err != nil {
		closeFD(fd)
		return nil, err
	}
	return &NetNS{id: id, fd: fd}, nil
}

// Open opens the network namespace at path.
func Open(path string) (*NetNS, error) {
	fd, err := openFD(path)
	if err != nil {
		return nil, err
	}
	return FromFD(fd)
}

// ID returns the namespace's identity; it stays valid after Close.
func (n *NetNS) ID() ID { return n.id }

// Close closes the fd. Sockets already opened in the namespace keep working; Do fails
// afterwards. Close is idempotent.
func (n *NetNS) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.fd < 0 {
		return nil
	}
	err := closeFD(n.fd)
	n.fd = -1
	return err
}

// Do runs fn on an OS thread inside the namespace and returns fn's error. A socket fn creates
// belongs to the namespace for its whole life, so fn may open listeners that other goroutines
// then serve. fn must not start goroutines that create sockets: they run elsewhere.
func (n *NetNS) Do(fn func() error) error { return n.do(fn) }

// Sockets opens sockets inside one network namespace with the options in-pod mode needs: the
// socket factory a per-pod proxy takes. The zero value opens plain sockets in the process's
// own namespace.
type Sockets struct {
	NS        *NetNS // nil: the process's own namespace
	Mark      uint32 // SO_MARK on every socket, listeners and dials (PACKET_MARK); 0: none
	ReusePort bool   // SO_REUSEPORT on listeners (INPOD_PORT_REUSE)
	// Transparent sets IP_TRANSPARENT on listeners, so that they also accept connections
	// istio-cni hands over with TPROXY (some of its releases do, for 15006 and 15008) as
	// well as REDIRECT'd ones; it needs CAP_NET_ADMIN, as in-pod mode does anyway.
	Transparent bool
}

// Listen opens a stream listener (net.ListenConfig.Listen) inside the namespace. Accepted
// connections get no TCP keepalive from Go: the proxy sets its own (KEEPALIVE_*), or none.
func (s Sockets) Listen(ctx context.Context, network, address string) (net.Listener, error) {
	return s.listen(ctx, network, address)
}

// ListenPacket opens a packet listener (net.ListenConfig.ListenPacket) inside the namespace.
func (s Sockets) ListenPacket(ctx context.Context, network, address string) (net.PacketConn, error) {
	return s.listenPacket(ctx, network, address)
}

// Dial connects from inside the namespace with d's settings (nil: a zero net.Dialer); d's own
// Control or ControlContext runs after the mark is set. With a namespace, address must be an
// IP and port: a name could resolve to several addresses, which net.Dialer races on goroutines
// that run outside the namespace.
//
// Only the socket is created inside the namespace (a socket belongs to the namespace it was
// made in, for life); the connect runs on the calling goroutine through the runtime's poller,
// so no OS thread is held, and no namespace switched, while it waits. Holding a locked thread
// through every connect made new connections in in-pod mode 40% slower than outside it.
func (s Sockets) Dial(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
	return s.dial(ctx, d, network, address)
}

// CheckCapabilities reports whether this process can do what in-pod mode needs: enter a
// network namespace (setns, which needs CAP_SYS_ADMIN) and mark its sockets (SO_MARK, which
// needs CAP_NET_ADMIN, or CAP_NET_RAW since Linux 5.17). The error names each capability
// that is missing.
func CheckCapabilities() error { return checkCapabilities() }
