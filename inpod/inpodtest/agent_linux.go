//go:build linux

package inpodtest

import (
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/netns"
)

// timeout bounds each of the agent's waits for ztunnel.
const timeout = 10 * time.Second

// Agent is the istio-cni node agent's side of ZDS: a SOCK_SEQPACKET listener ztunnel
// connects to, scripted by the test one packet at a time (bad ones included) on the wire
// helpers of inpod/zdsagent, whose Agent replays a fixed set of pods instead. Each
// method fails the test on an error; everything closes when it ends.
type Agent struct {
	t    testing.TB
	Path string
	ln   *net.UnixListener
}

// NewAgent listens on path (see SocketPath).
func NewAgent(t testing.TB, path string) *Agent {
	t.Helper()
	ln, err := zdsagent.ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &Agent{t: t, Path: path, ln: ln}
}

// Close stops listening and removes the socket file: the agent has gone away.
func (a *Agent) Close() { a.ln.Close() }

// SocketPath is a fresh socket path in a short temporary directory (sun_path holds 108
// bytes), removed when t ends.
func SocketPath(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "zds")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "ztunnel.sock")
}

// AgentConn is one accepted connection from ztunnel.
type AgentConn struct {
	t testing.TB
	C *net.UnixConn
}

// Accept waits for ztunnel to connect and checks its hello, the bare bytes 08 01.
func (a *Agent) Accept() *AgentConn {
	a.t.Helper()
	a.ln.SetDeadline(time.Now().Add(timeout))
	c, err := a.ln.AcceptUnix()
	if err != nil {
		a.t.Fatalf("agent: accept: %v", err)
	}
	a.t.Cleanup(func() { c.Close() })
	if err := zdsagent.ReadHello(c, timeout); err != nil {
		a.t.Fatalf("agent: %v", err)
	}
	return &AgentConn{t: a.t, C: c}
}

// Read reads one packet.
func (c *AgentConn) Read() []byte {
	c.t.Helper()
	b, err := zdsagent.Read(c.C, timeout)
	if err != nil {
		c.t.Fatalf("agent: read: %v", err)
	}
	return b
}

// SendRaw sends one packet with fds as SCM_RIGHTS and closes the agent's copies of them.
func (c *AgentConn) SendRaw(b []byte, fds ...int) {
	c.t.Helper()
	if err := zdsagent.Send(c.C, b, fds, 5*time.Second); err != nil {
		c.t.Fatalf("agent: send: %v", err)
	}
}

// Ack reads ztunnel's answer to one request: "" for an ACK, else the NACK's error.
func (c *AgentConn) Ack() string {
	c.t.Helper()
	nack, err := zdsagent.ReadAck(c.C, timeout)
	if err != nil {
		c.t.Fatalf("agent: %v", err)
	}
	return nack
}

// Send sends req with fds and returns the answer (see Ack).
func (c *AgentConn) Send(req *zdspb.WorkloadRequest, fds ...int) string {
	c.t.Helper()
	b, err := proto.Marshal(req)
	if err != nil {
		c.t.Fatal(err)
	}
	c.SendRaw(b, fds...)
	return c.Ack()
}

// Add sends Add for uid with a fresh fd of ns and the test info AddReq gives it.
func (c *AgentConn) Add(uid string, ns *netns.NetNS) string {
	c.t.Helper()
	return c.Send(AddReq(uid), NSFD(c.t, ns))
}

// AddPod sends Add for uid with info and a fresh fd of ns, as istio-cni does for a pod.
func (c *AgentConn) AddPod(uid string, info *zdspb.WorkloadInfo, ns *netns.NetNS) string {
	c.t.Helper()
	return c.Send(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid: uid, WorkloadInfo: info,
	}}}, NSFD(c.t, ns))
}

// WantClosed checks that ztunnel dropped the connection, and closes the agent's end.
func (c *AgentConn) WantClosed() {
	c.t.Helper()
	c.C.SetReadDeadline(time.Now().Add(timeout))
	n, err := c.C.Read(make([]byte, 2048))
	if n != 0 || (err != nil && !errors.Is(err, io.EOF)) {
		c.t.Fatalf("agent: read %d bytes, %v; want the connection closed", n, err)
	}
	c.C.Close()
}

// AddReq is Add for uid with workload info default/pod-<uid>, service account sa-<uid>.
func AddReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid:          uid,
		WorkloadInfo: &zdspb.WorkloadInfo{Name: "pod-" + uid, Namespace: "default", ServiceAccount: "sa-" + uid},
	}}}
}

// KeepReq is Keep for uid.
func KeepReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
}

// DelReq is Del for uid.
func DelReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
}

// SnapshotReq is SnapshotSent.
func SnapshotReq() *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}
}

// NSFD opens a new fd of ns, as istio-cni holds one per pod.
func NSFD(t testing.TB, ns *netns.NetNS) int {
	t.Helper()
	fd := -1
	if err := ns.Do(func() (err error) {
		fd, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return fd
}
