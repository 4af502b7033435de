//go:build linux

package inpod_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
)

// agent is the istio-cni node agent's side: a SOCK_SEQPACKET listener ztunnel connects to.
type agent struct {
	t    *testing.T
	path string
	ln   *net.UnixListener
}

func newAgent(t *testing.T, path string) *agent {
	t.Helper()
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &agent{t: t, path: path, ln: ln}
}

func socketPath(t *testing.T) string {
	dir, err := os.MkdirTemp("", "zds") // short: sun_path holds 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "ztunnel.sock")
}

// agentConn is one accepted connection from ztunnel.
type agentConn struct {
	t *testing.T
	c *net.UnixConn
}

// accept waits for ztunnel to connect and checks its hello, the bare bytes 08 01.
func (a *agent) accept() *agentConn {
	a.t.Helper()
	a.ln.SetDeadline(time.Now().Add(10 * time.Second))
	c, err := a.ln.AcceptUnix()
	if err != nil {
		a.t.Fatalf("agent: accept: %v", err)
	}
	a.t.Cleanup(func() { c.Close() })
	ac := &agentConn{t: a.t, c: c}
	if got := ac.read(); !bytes.Equal(got, []byte{0x08, 0x01}) {
		a.t.Fatalf("hello = % x; want 08 01", got)
	}
	return ac
}

func (c *agentConn) read() []byte {
	c.t.Helper()
	b := make([]byte, 2048)
	c.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := c.c.Read(b)
	if err != nil {
		c.t.Fatalf("agent: read: %v", err)
	}
	return b[:n]
}

// sendRaw sends one packet with fds as SCM_RIGHTS and closes the agent's copies of them.
func (c *agentConn) sendRaw(b []byte, fds ...int) {
	c.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _, err := c.c.WriteMsgUnix(b, oob, nil)
	for _, fd := range fds {
		unix.Close(fd)
	}
	if err != nil {
		c.t.Fatalf("agent: send: %v", err)
	}
}

// ack reads ztunnel's answer to one request: "" for an ACK, else the NACK's error.
func (c *agentConn) ack() string {
	c.t.Helper()
	var resp zdspb.WorkloadResponse
	if err := proto.Unmarshal(c.read(), &resp); err != nil {
		c.t.Fatalf("agent: bad response: %v", err)
	}
	if resp.GetAck() == nil {
		c.t.Fatalf("agent: response without an ack: %v", &resp)
	}
	return resp.GetAck().GetError()
}

func (c *agentConn) send(req *zdspb.WorkloadRequest, fds ...int) string {
	c.t.Helper()
	b, err := proto.Marshal(req)
	if err != nil {
		c.t.Fatal(err)
	}
	c.sendRaw(b, fds...)
	return c.ack()
}

// add sends Add for uid with a fresh fd of ns.
func (c *agentConn) add(uid string, ns *netns.NetNS) string {
	c.t.Helper()
	return c.send(addReq(uid), nsFD(c.t, ns))
}

// wantClosed checks that ztunnel dropped the connection, and closes the agent's end.
func (c *agentConn) wantClosed() {
	c.t.Helper()
	c.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := c.c.Read(make([]byte, 2048))
	if n != 0 || (err != nil && !errors.Is(err, io.EOF)) {
		c.t.Fatalf("agent: read %d bytes, %v; want the connection closed", n, err)
	}
	c.c.Close()
}

func addReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid:          uid,
		WorkloadInfo: &zdspb.WorkloadInfo{Name: "pod-" + uid, Namespace: "default", ServiceAccount: "sa-" + uid},
	}}}
}

func keepReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
}

func delReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
}

func snapshotReq() *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}
}

// nsFD opens a new fd of ns, as istio-cni holds one per pod.
func nsFD(t *testing.T, ns *netns.NetNS) int {
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

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// setup starts an agent and a Manager with proxies f, and checks for leaked goroutines.
func setup(t *testing.T, f *inpodtest.Proxies) (*inpod.Manager, *agent) {
	t.Helper()
	leaktest.Check(t) // first, so that its check runs after every other cleanup
	path := socketPath(t)
	a := newAgent(t, path)
	m := inpod.New(inpod.Config{
		Path:          path,
		RetryInterval: 50 * time.Millisecond,
		MinBackoff:    time.Millisecond,
		MaxBackoff:    50 * time.Millisecond,
	}, f)
	t.Cleanup(func() { m.Close() })
	return m, a
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func wantCalls(t *testing.T, f *inpodtest.Proxies, want string) {
	t.Helper()
	if got := f.Calls(); got != want {
		t.Errorf("proxy calls %q; want %q", got, want)
	}
}

func wantAck(t *testing.T, got string) {
	t.Helper()
	if got != "" {
		t.Fatalf("NACK %q; want ACK", got)
	}
}

// The whole exchange on one connection: hello, Add/Keep, SnapshotSent, Del.
func TestSnapshotThenDel(t *testing.T) {
	nsA := netns.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.accept()

	wantAck(t, c.add("a", nsA))
	wantAck(t, c.send(keepReq("b")))
	if m.Ready() {
		t.Error("ready before the snapshot")
	}
	wantAck(t, c.send(snapshotReq()))
	if !m.Ready() {
		t.Error("not ready after the snapshot")
	}
	wantCalls(t, f, "start a")
	want := inpod.PodState{State: inpod.StateUp, Info: inpod.WorkloadInfo{Name: "pod-a", Namespace: "default", ServiceAccount: "sa-a"}}
	if ws := m.WorkloadState(); len(ws) != 1 || ws["a"] != want {
		t.Errorf("workload state %v; want a: %v", ws, want)
	}
	if got := m.Stats(); got != (inpod.Stats{Active: 1, Started: 1}) {
		t.Errorf("stats %+v", got)
	}

	wantAck(t, c.send(delReq("b"))) // kept, never started: nothing to stop
	wantAck(t, c.send(delReq("a")))
	wantCalls(t, f, "stop a")
	if ws := m.WorkloadState(); len(ws) != 0 {
		t.Errorf("workload state after Del: %v", ws)
	}
	if got := m.Stats(); got != (inpod.Stats{Started: 1, Stopped: 1}) {
		t.Errorf("stats %+v", got)
	}
	wantAck(t, c.send(delReq("a"))) // again: still an ACK
	m.Close()
	c.wantClosed()
	if m.Ready() {
		t.Error("ready after Close")
	}
}

// An agent restart replays its cache: running pods it names keep running untouched, a pod
// it no longer names is drained.
func TestAgentRestart(t *testing.T) {
	nsA, nsB := netns.NewAnonymous(t), netns.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.accept()
	wantAck(t, c.add("a", nsA))
	wantAck(t, c.add("b", nsB))
	wantAck(t, c.send(snapshotReq()))
	wantCalls(t, f, "start a, start b")

	// The agent goes away: listener and connection closed, the socket file removed.
	c.c.Close()
	a.ln.Close()
	eventually(t, "not ready while disconnected", func() bool { return !m.Ready() })
	a = newAgent(t, a.path)
	c = a.accept()
	wantAck(t, c.add("a", nsA)) // same netns, new fd
	wantAck(t, c.send(keepReq("b")))
	if m.Ready() {
		t.Error("ready before the new connection's snapshot")
	}
	wantAck(t, c.send(snapshotReq()))
	wantCalls(t, f, "")
	if !m.Ready() {
		t.Error("not ready after the replayed snapshot")
	}

	c.c.Close() // the agent restarts again and no longer knows b
	c = a.accept()
	wantAck(t, c.add("a", nsA))
	wantAck(t, c.send(snapshotReq()))
	wantCalls(t, f, "drain b")
	if got := m.Stats(); got != (inpod.Stats{Active: 1, Started: 2, Stopped: 1}) {
		t.Errorf("stats %+v", got)
	}

	// Before a snapshot, Del unnames a pod; the reconcile then drains it.
	c.c.Close()
	c = a.accept()
	wantAck(t, c.add("a", nsA))
	wantAck(t, c.send(delReq("a")))
	wantCalls(t, f, "")
	wantAck(t, c.send(snapshotReq()))
	wantCalls(t, f, "drain a")
}

// The same netns twice is one Start; a new netns for the uid replaces the proxy.
func TestAddSameAndNewNetns(t *testing.T) {
	ns1, ns2 := netns.NewAnonymous(t), netns.NewAnonymous(t)
	f := &inpodtest.Proxies{Listen: "127.0.0.1:15008"}
	m, a := setup(t, f)
	c := a.accept()
	before := openFDs(t)
	wantAck(t, c.add("a", ns1))
	wantAck(t, c.add("a", ns1))
	wantAck(t, c.send(snapshotReq()))
	wantAck(t, c.add("a", ns1))
	wantCalls(t, f, "start a")
	wantAck(t, c.add("a", ns2))
	wantCalls(t, f, "stop a, start a")
	if got := m.Stats(); got != (inpod.Stats{Active: 1, Started: 2, Stopped: 1}) {
		t.Errorf("stats %+v", got)
	}
	wantAck(t, c.send(delReq("a")))
	wantCalls(t, f, "stop a")
	if got := openFDs(t); got != before {
		t.Errorf("%d fds open; want %d as before", got, before)
	}
}

// Del stops only its pod.
func TestDelStopsOnlyThatPod(t *testing.T) {
	ns := netns.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.accept()
	for _, uid := range []string{"a", "b", "c"} {
		wantAck(t, c.add(uid, ns))
	}
	wantAck(t, c.send(snapshotReq()))
	wantCalls(t, f, "start a, start b, start c")
	wantAck(t, c.send(delReq("b")))
	wantCalls(t, f, "stop b")
	if ws := m.WorkloadState(); len(ws) != 2 || ws["a"].State != inpod.StateUp || ws["c"].State != inpod.StateUp {
		t.Errorf("workload state %v; want a and c up", ws)
	}
}

// A pod whose proxy cannot bind is NACKed, kept pending (not ready) and retried until it
// starts; the connection stays up throughout.
func TestStartFailureRetried(t *testing.T) {
	ns := netns.NewAnonymous(t)
	blocker, err := netns.Sockets{NS: ns}.Listen(t.Context(), "tcp", "127.0.0.1:15008")
	if err != nil {
		t.Fatal(err)
	}
	f := &inpodtest.Proxies{Listen: "127.0.0.1:15008"}
	m, a := setup(t, f)
	c := a.accept()

	got := c.add("a", ns)
	if !strings.HasPrefix(got, "failure to start proxy : ") || !strings.Contains(got, "address already in use") {
		t.Fatalf("NACK %q; want a start failure naming the bind error", got)
	}
	wantAck(t, c.send(snapshotReq()))
	if m.Ready() {
		t.Error("ready with a pending pod")
	}
	if st := m.WorkloadState()["a"].State; st != inpod.StatePending {
		t.Errorf("state %q; want Pending", st)
	}
	if s := m.Stats(); s.Pending != 1 || s.Active != 0 {
		t.Errorf("stats %+v; want 1 pending", s)
	}

	blocker.Close()
	eventually(t, "the retried pod to start", m.Ready)
	if st := m.WorkloadState()["a"].State; st != inpod.StateUp {
		t.Errorf("state %q; want Up", st)
	}
	if calls := f.Calls(); !strings.HasSuffix(calls, "start-failed a, start a") {
		t.Errorf("calls %q; want retries ending in a start", calls)
	}
	wantAck(t, c.send(delReq("a"))) // same connection
	wantCalls(t, f, "stop a")

	// A pending pod that is deleted releases its netns and stops being retried.
	blocker, err = netns.Sockets{NS: ns}.Listen(t.Context(), "tcp", "127.0.0.1:15008")
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Close()
	before := openFDs(t)
	if got := c.add("b", ns); !strings.HasPrefix(got, "failure to start proxy : ") {
		t.Fatalf("NACK %q; want a start failure", got)
	}
	wantAck(t, c.send(delReq("b")))
	if got := openFDs(t); got != before {
		t.Errorf("%d fds open; want %d as before", got, before)
	}
	eventually(t, "ready without pending pods", m.Ready)
}

// Malformed packets are NACKed as read errors and protocol errors as process errors; either
// drops the connection, ztunnel redials, and no fd leaks.
func TestBadInput(t *testing.T) {
	ns := netns.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)

	marshal := func(req *zdspb.WorkloadRequest) []byte {
		b, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	pipe := func() []int {
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		return p[:]
	}
	devNull := func() int {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		return fd
	}
	const readErr, processErr = "failure to read message : ", "failure to process message : "
	noInfo := addReq("x")
	noInfo.GetAdd().WorkloadInfo = nil
	big := marshal(addReq(strings.Repeat("x", 2000)))
	baseline := -1
	for _, tc := range []struct {
		name string
		send func(c *agentConn)
		want string
	}{
		{"add without fd", func(c *agentConn) { c.sendRaw(marshal(addReq("x"))) }, readErr},
		{"add with a pipe", func(c *agentConn) { p := pipe(); unix.Close(p[1]); c.sendRaw(marshal(addReq("x")), p[0]) }, readErr},
		{"add with /dev/null", func(c *agentConn) { c.sendRaw(marshal(addReq("x")), devNull()) }, readErr},
		{"add with two fds", func(c *agentConn) { c.sendRaw(marshal(addReq("x")), nsFD(t, ns), nsFD(t, ns)) }, readErr},
		{"add with many fds", func(c *agentConn) {
			var fds []int
			for range 8 {
				fds = append(fds, devNull())
			}
			c.sendRaw(marshal(addReq("x")), fds...)
		}, readErr},
		{"keep with an fd", func(c *agentConn) { c.sendRaw(marshal(keepReq("x")), nsFD(t, ns)) }, readErr},
		{"garbage", func(c *agentConn) { c.sendRaw([]byte{0xff, 0xff, 0xff, 0xff}, nsFD(t, ns)) }, readErr},
		{"unknown payload", func(c *agentConn) { c.sendRaw([]byte{0x48, 0x01}) }, readErr},
		{"oversized", func(c *agentConn) { c.sendRaw(big, nsFD(t, ns)) }, readErr},
		{"add without workload info", func(c *agentConn) { c.sendRaw(marshal(noInfo), nsFD(t, ns)) }, processErr},
		{"keep after snapshot", func(c *agentConn) {
			wantAck(t, c.send(snapshotReq()))
			c.sendRaw(marshal(keepReq("x")))
		}, processErr},
		{"second snapshot", func(c *agentConn) {
			wantAck(t, c.send(snapshotReq()))
			c.sendRaw(marshal(snapshotReq()))
		}, processErr},
	} {
		c := a.accept()
		// Each connection starts with the same fds open: the previous one released all.
		if got := openFDs(t); baseline < 0 {
			baseline = got
		} else if got != baseline {
			t.Errorf("before %s: %d fds open; want %d", tc.name, got, baseline)
		}
		tc.send(c)
		if got := c.ack(); !strings.HasPrefix(got, tc.want) {
			t.Errorf("%s: answer %q; want prefix %q", tc.name, got, tc.want)
		}
		c.wantClosed()
	}
	// Still serving, with nothing leaked or started.
	c := a.accept()
	if got := openFDs(t); got != baseline {
		t.Errorf("after all: %d fds open; want %d", got, baseline)
	}
	wantAck(t, c.add("a", ns))
	wantAck(t, c.send(snapshotReq()))
	wantCalls(t, f, "start a")
	if !m.Ready() {
		t.Error("not ready after a good snapshot")
	}
}

// 500 add/delete cycles leave fds and goroutines where they were.
func TestAddDelCycles(t *testing.T) {
	ns := netns.NewAnonymous(t)
	f := &inpodtest.Proxies{Listen: "127.0.0.1:15008"}
	m, a := setup(t, f)
	c := a.accept()
	wantAck(t, c.send(snapshotReq()))
	before := openFDs(t)
	for i := range 500 {
		uid := "pod-" + string(rune('a'+i%26))
		wantAck(t, c.add(uid, ns))
		wantAck(t, c.send(delReq(uid)))
	}
	if got := openFDs(t); got != before {
		t.Errorf("%d fds open after 500 cycles; want %d", got, before)
	}
	if s := m.Stats(); s != (inpod.Stats{Started: 500, Stopped: 500}) {
		t.Errorf("stats %+v", s)
	}
	if f.Running() != 0 {
		t.Errorf("%d proxies still run", f.Running())
	}
}

// Close drains every proxy gracefully and releases pending pods' namespaces.
func TestCloseDrains(t *testing.T) {
	ns := netns.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.accept()
	before := openFDs(t)
	wantAck(t, c.add("b", ns))
	wantAck(t, c.add("a", ns))
	wantAck(t, c.send(snapshotReq()))
	m.Close()
	m.Close()
	wantCalls(t, f, "start b, start a, drain a, drain b")
	c.wantClosed()
	if got := openFDs(t); got != before-2 { // less both ends of the connection
		t.Errorf("%d fds open; want %d", got, before-2)
	}
}
