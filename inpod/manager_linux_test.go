//go:build linux

package inpod_test

import (
	"os"
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
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// setup starts an agent and a Manager with proxies f, and checks for leaked goroutines.
func setup(t *testing.T, f *inpodtest.Proxies) (*inpod.Manager, *inpodtest.Agent) {
	t.Helper()
	leaktest.Check(t) // first, so that its check runs after every other cleanup
	path := inpodtest.SocketPath(t)
	a := inpodtest.NewAgent(t, path)
	m := inpod.New(inpod.Config{
		Path:          path,
		RetryInterval: 50 * time.Millisecond,
		MinBackoff:    time.Millisecond,
		MaxBackoff:    50 * time.Millisecond,
	}, f)
	t.Cleanup(func() { m.Close() })
	return m, a
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
	nsA := netnstest.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.Accept()

	wantAck(t, c.Add("a", nsA))
	wantAck(t, c.Send(inpodtest.KeepReq("b")))
	if m.Ready() {
		t.Error("ready before the snapshot")
	}
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
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

	wantAck(t, c.Send(inpodtest.DelReq("b"))) // kept, never started: nothing to stop
	wantAck(t, c.Send(inpodtest.DelReq("a")))
	wantCalls(t, f, "stop a")
	if ws := m.WorkloadState(); len(ws) != 0 {
		t.Errorf("workload state after Del: %v", ws)
	}
	if got := m.Stats(); got != (inpod.Stats{Started: 1, Stopped: 1}) {
		t.Errorf("stats %+v", got)
	}
	wantAck(t, c.Send(inpodtest.DelReq("a"))) // again: still an ACK
	m.Close()
	c.WantClosed()
	if m.Ready() {
		t.Error("ready after Close")
	}
}

// An agent restart replays its cache: running pods it names keep running untouched, a pod
// it no longer names is drained.
func TestAgentRestart(t *testing.T) {
	nsA, nsB := netnstest.NewAnonymous(t), netnstest.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.Accept()
	wantAck(t, c.Add("a", nsA))
	wantAck(t, c.Add("b", nsB))
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantCalls(t, f, "start a, start b")

	// The agent goes away: listener and connection closed, the socket file removed.
	c.C.Close()
	a.Close()
	testutil.Eventually(t, "not ready while disconnected", func() bool { return !m.Ready() })
	a = inpodtest.NewAgent(t, a.Path)
	c = a.Accept()
	wantAck(t, c.Add("a", nsA)) // same netns, new fd
	wantAck(t, c.Send(inpodtest.KeepReq("b")))
	if m.Ready() {
		t.Error("ready before the new connection's snapshot")
	}
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantCalls(t, f, "")
	if !m.Ready() {
		t.Error("not ready after the replayed snapshot")
	}

	c.C.Close() // the agent restarts again and no longer knows b
	c = a.Accept()
	wantAck(t, c.Add("a", nsA))
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantCalls(t, f, "drain b")
	if got := m.Stats(); got != (inpod.Stats{Active: 1, Started: 2, Stopped: 1}) {
		t.Errorf("stats %+v", got)
	}

	// Before a snapshot, Del unnames a pod; the reconcile then drains it.
	c.C.Close()
	c = a.Accept()
	wantAck(t, c.Add("a", nsA))
	wantAck(t, c.Send(inpodtest.DelReq("a")))
	wantCalls(t, f, "")
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantCalls(t, f, "drain a")
}

// The same netns twice is one Start; a new netns for the uid replaces the proxy.
func TestAddSameAndNewNetns(t *testing.T) {
	ns1, ns2 := netnstest.NewAnonymous(t), netnstest.NewAnonymous(t)
	f := &inpodtest.Proxies{Listen: "127.0.0.1:15008"}
	m, a := setup(t, f)
	c := a.Accept()
	before := openFDs(t)
	wantAck(t, c.Add("a", ns1))
	wantAck(t, c.Add("a", ns1))
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantAck(t, c.Add("a", ns1))
	wantCalls(t, f, "start a")
	wantAck(t, c.Add("a", ns2))
	wantCalls(t, f, "stop a, start a")
	if got := m.Stats(); got != (inpod.Stats{Active: 1, Started: 2, Stopped: 1}) {
		t.Errorf("stats %+v", got)
	}
	wantAck(t, c.Send(inpodtest.DelReq("a")))
	wantCalls(t, f, "stop a")
	if got := openFDs(t); got != before {
		t.Errorf("%d fds open; want %d as before", got, before)
	}
}

// Del stops only its pod.
func TestDelStopsOnlyThatPod(t *testing.T) {
	ns := netnstest.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.Accept()
	for _, uid := range []string{"a", "b", "c"} {
		wantAck(t, c.Add(uid, ns))
	}
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantCalls(t, f, "start a, start b, start c")
	wantAck(t, c.Send(inpodtest.DelReq("b")))
	wantCalls(t, f, "stop b")
	if ws := m.WorkloadState(); len(ws) != 2 || ws["a"].State != inpod.StateUp || ws["c"].State != inpod.StateUp {
		t.Errorf("workload state %v; want a and c up", ws)
	}
}

// A pod whose proxy cannot bind is NACKed, kept pending (not ready) and retried until it
// starts; the connection stays up throughout.
func TestStartFailureRetried(t *testing.T) {
	ns := netnstest.NewAnonymous(t)
	blocker, err := netns.Sockets{NS: ns}.Listen(t.Context(), "tcp", "127.0.0.1:15008")
	if err != nil {
		t.Fatal(err)
	}
	f := &inpodtest.Proxies{Listen: "127.0.0.1:15008"}
	m, a := setup(t, f)
	c := a.Accept()

	got := c.Add("a", ns)
	if !strings.HasPrefix(got, "failure to start proxy : ") || !strings.Contains(got, "address already in use") {
		t.Fatalf("NACK %q; want a start failure naming the bind error", got)
	}
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
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
	testutil.Eventually(t, "the retried pod to start", m.Ready)
	if st := m.WorkloadState()["a"].State; st != inpod.StateUp {
		t.Errorf("state %q; want Up", st)
	}
	if calls := f.Calls(); !strings.HasSuffix(calls, "start-failed a, start a") {
		t.Errorf("calls %q; want retries ending in a start", calls)
	}
	wantAck(t, c.Send(inpodtest.DelReq("a"))) // same connection
	wantCalls(t, f, "stop a")

	// A pending pod that is deleted releases its netns and stops being retried.
	blocker, err = netns.Sockets{NS: ns}.Listen(t.Context(), "tcp", "127.0.0.1:15008")
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Close()
	before := openFDs(t)
	if got := c.Add("b", ns); !strings.HasPrefix(got, "failure to start proxy : ") {
		t.Fatalf("NACK %q; want a start failure", got)
	}
	wantAck(t, c.Send(inpodtest.DelReq("b")))
	if got := openFDs(t); got != before {
		t.Errorf("%d fds open; want %d as before", got, before)
	}
	testutil.Eventually(t, "ready without pending pods", m.Ready)
}

// Malformed packets are NACKed as read errors and protocol errors as process errors; either
// drops the connection, ztunnel redials, and no fd leaks.
func TestBadInput(t *testing.T) {
	ns := netnstest.NewAnonymous(t)
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
	noInfo := inpodtest.AddReq("x")
	noInfo.GetAdd().WorkloadInfo = nil
	big := marshal(inpodtest.AddReq(strings.Repeat("x", 2000)))
	baseline := -1
	for _, tc := range []struct {
		name string
		send func(c *inpodtest.AgentConn)
		want string
	}{
		{"add without fd", func(c *inpodtest.AgentConn) { c.SendRaw(marshal(inpodtest.AddReq("x"))) }, readErr},
		{"add with a pipe", func(c *inpodtest.AgentConn) {
			p := pipe()
			unix.Close(p[1])
			c.SendRaw(marshal(inpodtest.AddReq("x")), p[0])
		}, readErr},
		{"add with /dev/null", func(c *inpodtest.AgentConn) { c.SendRaw(marshal(inpodtest.AddReq("x")), devNull()) }, readErr},
		{"add with two fds", func(c *inpodtest.AgentConn) {
			c.SendRaw(marshal(inpodtest.AddReq("x")), inpodtest.NSFD(t, ns), inpodtest.NSFD(t, ns))
		}, readErr},
		{"add with many fds", func(c *inpodtest.AgentConn) {
			var fds []int
			for range 8 {
				fds = append(fds, devNull())
			}
			c.SendRaw(marshal(inpodtest.AddReq("x")), fds...)
		}, readErr},
		{"keep with an fd", func(c *inpodtest.AgentConn) { c.SendRaw(marshal(inpodtest.KeepReq("x")), inpodtest.NSFD(t, ns)) }, readErr},
		{"garbage", func(c *inpodtest.AgentConn) { c.SendRaw([]byte{0xff, 0xff, 0xff, 0xff}, inpodtest.NSFD(t, ns)) }, readErr},
		{"unknown payload", func(c *inpodtest.AgentConn) { c.SendRaw([]byte{0x48, 0x01}) }, readErr},
		{"oversized", func(c *inpodtest.AgentConn) { c.SendRaw(big, inpodtest.NSFD(t, ns)) }, readErr},
		{"add without workload info", func(c *inpodtest.AgentConn) { c.SendRaw(marshal(noInfo), inpodtest.NSFD(t, ns)) }, processErr},
		{"keep after snapshot", func(c *inpodtest.AgentConn) {
			wantAck(t, c.Send(inpodtest.SnapshotReq()))
			c.SendRaw(marshal(inpodtest.KeepReq("x")))
		}, processErr},
		{"second snapshot", func(c *inpodtest.AgentConn) {
			wantAck(t, c.Send(inpodtest.SnapshotReq()))
			c.SendRaw(marshal(inpodtest.SnapshotReq()))
		}, processErr},
	} {
		c := a.Accept()
		// Each connection starts with the same fds open: the previous one released all.
		if got := openFDs(t); baseline < 0 {
			baseline = got
		} else if got != baseline {
			t.Errorf("before %s: %d fds open; want %d", tc.name, got, baseline)
		}
		tc.send(c)
		if got := c.Ack(); !strings.HasPrefix(got, tc.want) {
			t.Errorf("%s: answer %q; want prefix %q", tc.name, got, tc.want)
		}
		c.WantClosed()
	}
	// Still serving, with nothing leaked or started.
	c := a.Accept()
	if got := openFDs(t); got != baseline {
		t.Errorf("after all: %d fds open; want %d", got, baseline)
	}
	wantAck(t, c.Add("a", ns))
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	wantCalls(t, f, "start a")
	if !m.Ready() {
		t.Error("not ready after a good snapshot")
	}
}

// 500 add/delete cycles leave fds and goroutines where they were.
func TestAddDelCycles(t *testing.T) {
	ns := netnstest.NewAnonymous(t)
	f := &inpodtest.Proxies{Listen: "127.0.0.1:15008"}
	m, a := setup(t, f)
	c := a.Accept()
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	before := openFDs(t)
	for i := range 500 {
		uid := "pod-" + string(rune('a'+i%26))
		wantAck(t, c.Add(uid, ns))
		wantAck(t, c.Send(inpodtest.DelReq(uid)))
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
	ns := netnstest.NewAnonymous(t)
	f := &inpodtest.Proxies{}
	m, a := setup(t, f)
	c := a.Accept()
	before := openFDs(t)
	wantAck(t, c.Add("b", ns))
	wantAck(t, c.Add("a", ns))
	wantAck(t, c.Send(inpodtest.SnapshotReq()))
	m.Close()
	m.Close()
	wantCalls(t, f, "start b, start a, drain a, drain b")
	c.WantClosed()
	if got := openFDs(t); got != before-2 { // less both ends of the connection
		t.Errorf("%d fds open; want %d", got, before-2)
	}
}
