//go:build !linux

package netpoll

// New returns the node's poller: outside Linux, with no epoll, a goroutine per socket.
func New() (Poller, error) { return PerSocket{}, nil }
