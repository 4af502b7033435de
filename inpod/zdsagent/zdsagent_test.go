//go:build linux

package zdsagent_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// Two Managers connect to one agent, as an old and a new ztunnel do during an upgrade: each
// gets the whole snapshot replayed with its own fd of the pod's netns, and later changes go
// to the newest only. The netns is this process's own, which needs no root.
func TestAgentReplaysToEveryConnection(t *testing.T) {
	leaktest.Check(t)
	path := filepath.Join(t.TempDir(), "z.sock")
	agent, err := zdsagent.Listen(path, zdsagent.Pod{UID: "a", Name: "a", Namespace: "default", ServiceAccount: "sa", NetNS: "/proc/self/ns/net"})
	if err != nil {
		t.Fatal(err)
	}
	replayed := make(chan error, 2)
	served := make(chan error, 1)
	go func() { served <- agent.Serve(func(_ int, err error) { replayed <- err }) }()

	start := func() (*inpod.Manager, *inpodtest.Proxies) {
		p := &inpodtest.Proxies{}
		m := inpod.New(inpod.Config{Path: path}, p)
		if err := <-replayed; err != nil {
			t.Fatal(err)
		}
		testutil.Eventually(t, "the manager ready after the replay", m.Ready)
		return m, p
	}
	oldM, oldP := start()
	newM, newP := start()
	if got, want := oldP.Calls()+" | "+newP.Calls(), "start a | start a"; got != want {
		t.Errorf("calls %q; want %q", got, want)
	}
	if err := agent.Add(zdsagent.Pod{UID: "b", Name: "b", Namespace: "default", NetNS: "/proc/self/ns/net"}); err != nil {
		t.Fatal(err)
	}
	if err := agent.Del("a"); err != nil {
		t.Fatal(err)
	}
	if got, want := oldP.Calls()+" | "+newP.Calls(), " | start b, stop a"; got != want {
		t.Errorf("calls after Add b, Del a: %q; want %q (the newest connection only)", got, want)
	}
	oldM.Close()
	newM.Close()
	agent.Close()
	if err := <-served; err != nil {
		t.Errorf("Serve: %v", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("socket file after Close: %v; want it removed", err)
	}
}
