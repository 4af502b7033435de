// Package zdsagent is a small istio-cni node agent, ZDS's server side (see package inpod for
// the protocol), for the load generator, the in-pod demo and the upgrade test: it listens on
// a SOCK_SEQPACKET socket and, on every ztunnel connection, replays the pods it was given
// (Add with a fresh fd of each pod's netns, then SnapshotSent), as istio-cni does. Like
// istio-cni it sends later changes to the newest connection only and leaves older ones open
// until their ztunnel goes away, so that a second ztunnel takes the pods over while the
// first drains. It installs no rules (internal/cnirules) and creates no namespaces.
package zdsagent

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gozt/gozt/inpod/zdspb"
)

// Pod is one pod the agent hands ztunnel.
type Pod struct {
	UID                             string
	Name, Namespace, ServiceAccount string
	NetNS                           string // its network namespace: /var/run/netns/NAME, /proc/PID/ns/net
}

// Agent serves ZDS on one socket. Its methods are safe for concurrent use.
type Agent struct {
	Path string
	ln   listener

	mu     sync.Mutex
	pods   []Pod
	conns  []*Conn // accepted, oldest first; the last is the newest
	closed bool
}

// Listen starts an agent on path that replays pods to every connection; Serve accepts them.
func Listen(path string, pods ...Pod) (*Agent, error) {
	ln, err := listen(path)
	if err != nil {
		return nil, fmt.Errorf("zdsagent: %w", err)
	}
	return &Agent{Path: path, ln: ln, pods: pods}, nil
}

// Serve accepts ztunnel connections until Close and replays the pods on each (one at a
// time, as istio-cni does). onConn, if not nil, learns of each replay's outcome: the
// connection's number (1 for the first) and the error of a failed replay (a NACK, an I/O
// error).
func (a *Agent) Serve(onConn func(n int, err error)) error {
	for n := 1; ; n++ {
		c, err := a.ln.accept()
		if err != nil {
			if a.isClosed() {
				return nil
			}
			return fmt.Errorf("zdsagent: accept: %w", err)
		}
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			c.close()
			return nil
		}
		conn := &Conn{c: c}
		a.conns = append(a.conns, conn)
		pods := a.pods
		a.mu.Unlock()
		err = conn.replay(pods)
		if onConn != nil {
			onConn(n, err)
		}
	}
}

// Del sends Del for uid on the newest connection and forgets the pod.
func (a *Agent) Del(uid string) error {
	a.mu.Lock()
	a.pods = deleteUID(a.pods, uid)
	c := a.newest()
	a.mu.Unlock()
	if c == nil {
		return errors.New("zdsagent: no ztunnel connected")
	}
	return c.do(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}})
}

// Add sends Add for p on the newest connection and remembers it for later replays.
func (a *Agent) Add(p Pod) error {
	a.mu.Lock()
	a.pods = append(deleteUID(a.pods, p.UID), p)
	c := a.newest()
	a.mu.Unlock()
	if c == nil {
		return errors.New("zdsagent: no ztunnel connected")
	}
	return c.add(p)
}

func (a *Agent) newest() *Conn {
	if len(a.conns) == 0 {
		return nil
	}
	return a.conns[len(a.conns)-1]
}

func (a *Agent) isClosed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.closed
}

// Close stops listening, removes the socket and closes every connection: ztunnel sees the
// agent go away. It is idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	a.closed = true
	conns := a.conns
	a.conns = nil
	a.mu.Unlock()
	err := a.ln.close()
	for _, c := range conns {
		c.c.close()
	}
	return err
}

func deleteUID(pods []Pod, uid string) []Pod {
	var out []Pod
	for _, p := range pods {
		if p.UID != uid {
			out = append(out, p)
		}
	}
	return out
}

// Conn is one ztunnel connection; one request is in flight at a time.
type Conn struct {
	mu sync.Mutex
	c  packetConn
}

// replay sends every pod and SnapshotSent.
func (c *Conn) replay(pods []Pod) error {
	for _, p := range pods {
		if err := c.add(p); err != nil {
			return err
		}
	}
	return c.do(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}})
}

// add sends Add for p with a fresh fd of its netns.
func (c *Conn) add(p Pod) error {
	fd, err := openNetNS(p.NetNS)
	if err != nil {
		return fmt.Errorf("zdsagent: add %s: %w", p.UID, err)
	}
	return c.do(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid:          p.UID,
		WorkloadInfo: &zdspb.WorkloadInfo{Name: p.Name, Namespace: p.Namespace, ServiceAccount: p.ServiceAccount},
	}}}, fd)
}

// do sends req, passing fds (which it closes), and waits for the answer; a NACK is an error.
func (c *Conn) do(req *zdspb.WorkloadRequest, fds ...int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	nack, err := c.c.request(req, fds)
	if err != nil {
		return fmt.Errorf("zdsagent: %v: %w", req, err)
	}
	if nack != "" {
		return fmt.Errorf("zdsagent: %v: NACK %q", req, nack)
	}
	return nil
}
