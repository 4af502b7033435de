//go:build linux

package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

// TestNetnsInPodUpgrade is a ztunnel upgrade on a node in in-pod mode: a second ztunnel
// connects to the node agent while the first runs, gets the snapshot replayed with the same
// pod namespaces and binds its listeners beside the first one's (SO_REUSEPORT); then the
// first drains and exits. Pod A's client opens new connections to pod B, over HBONE, the
// whole time, and none may fail. A long-lived connection the old ztunnel accepted keeps
// working through its drain and is closed at its drain deadline, as in Istio: an L4
// connection cannot move to another process.
func TestNetnsInPodUpgrade(t *testing.T) {
	netnstest.Require(t, "iptables")
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	_, nsA, nsB, dir := inPodTopology(t)
	startPodServer(t, nsB, inPodB, "8080")

	agent, err := zdsagent.Listen(dir+"/ztunnel.sock",
		zdsagent.Pod{UID: "uid-a", Name: "client", Namespace: "default", ServiceAccount: "client", NetNS: "/var/run/netns/" + nsA.Name},
		zdsagent.Pod{UID: "uid-b", Name: "server", Namespace: "default", ServiceAccount: "server", NetNS: "/var/run/netns/" + nsB.Name})
	if err != nil {
		t.Fatal(err)
	}
	replayed := make(chan error, 2)
	served := make(chan error, 1)
	go func() { served <- agent.Serve(func(_ int, err error) { replayed <- err }) }()
	t.Cleanup(func() { // after both nodes have stopped (cleanups run last first)
		agent.Close()
		if err := <-served; err != nil {
			t.Errorf("agent: %v", err)
		}
	})
	const deadline = 2 * time.Second // the old ztunnel's CONNECTION_TERMINATION_DEADLINE
	env := inPodEnv(agent.Path, dir)
	env["CONNECTION_TERMINATION_DEADLINE"] = deadline.String()
	startReady := func(name string) (*ztunnel, func(), <-chan error) {
		t.Helper()
		n, stop, done := startStoppableNode(t, testConfig(t, env))
		if err := <-replayed; err != nil {
			t.Fatalf("%s: snapshot replay: %v", name, err)
		}
		if code, body := waitReady(t, n, "ready\n"); code != 200 {
			t.Fatalf("%s not ready: %d %q", name, code, body)
		}
		return n, stop, done
	}
	oldNode, stopOld, oldDone := startReady("old ztunnel")
	// Closing the old ztunnel's listeners moves the handshakes the kernel gave them to the
	// new one's rather than resetting them (without it, about one connection in 5000 failed).
	for _, ns := range []*netnstest.NS{nsA, nsB} {
		if got := strings.TrimSpace(ns.MustExec(t, "cat", "/proc/sys/net/ipv4/tcp_migrate_req")); got != "1" {
			t.Errorf("%s: tcp_migrate_req = %s; want 1, set by ztunnel", ns.Name, got)
		}
	}

	// The long-lived connection, accepted by the old ztunnel: the only one running.
	long, err := dialIn(nsA, "tcp", inPodB+":8080")
	if err != nil {
		t.Fatal(err)
	}
	defer long.Close()
	long.SetDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(long)
	roundTrip := func(path string) error {
		if _, err := fmt.Fprintf(long, "GET %s HTTP/1.1\r\nHost: server\r\n\r\n", path); err != nil {
			return err
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	if err := roundTrip("/long"); err != nil {
		t.Fatal(err)
	}

	// New connections, one after another on each of two clients, until stopLoad.
	var ok, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	stopLoad := make(chan struct{})
	var load sync.WaitGroup
	for i := range 2 {
		load.Add(1)
		go func() {
			defer load.Done()
			for n := 0; ; n++ {
				select {
				case <-stopLoad:
					return
				default:
				}
				out, err := plainGet(nsA, 0, inPodB+":8080", fmt.Sprintf("/new-%d-%d", i, n))
				if err == nil && !strings.Contains(out, "server pod port 8080 got GET /new-") {
					err = fmt.Errorf("response %q", out)
				}
				if err != nil {
					failed.Add(1)
					mu.Lock()
					failures = append(failures, fmt.Sprintf("%s: %v", time.Now().Format("15:04:05.000"), err))
					mu.Unlock()
					continue
				}
				ok.Add(1)
			}
		}()
	}
	defer func() { close(stopLoad); load.Wait() }() // also when a check below fails the test
	waitCount := func(what string, min int64) {
		t.Helper()
		testutil.Eventually(t, what, func() bool { return ok.Load() >= min })
	}
	waitCount("requests through the old ztunnel", ok.Load()+20)

	newNode, _, _ := startReady("new ztunnel")
	// Both run the pods' listeners now: the kernel spreads new connections over them.
	newOutbound := func() float64 {
		_, body := get(t, "http://"+newNode.addrs["STATS_ADDR"].String()+"/metrics")
		return metricSum(t, body, "istio_tcp_connections_opened_total", map[string]string{"reporter": "source", "connection_security_policy": "mutual_tls"})
	}
	testutil.Eventually(t, "the new ztunnel to carry some of pod A's connections", func() bool { return newOutbound() > 0 })
	if err := roundTrip("/long-after-new"); err != nil {
		t.Errorf("long-lived connection once the new ztunnel runs: %v", err)
	}

	drainStart := time.Now()
	stopOld()
	atDrain := ok.Load()
	// Through the drain the long-lived connection works...
	for time.Since(drainStart) < deadline*3/4 {
		if err := roundTrip("/long-during-drain"); err != nil {
			t.Errorf("long-lived connection %v into the old ztunnel's drain: %v", time.Since(drainStart), err)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case err := <-oldDone:
		if err != nil {
			t.Errorf("old ztunnel: %v", err)
		}
	case <-time.After(deadline + 10*time.Second):
		t.Fatal("old ztunnel did not exit after its drain deadline")
	}
	took := time.Since(drainStart)
	// ...and is closed at the deadline, with the process that owned it.
	if err := roundTrip("/long-after-exit"); err == nil {
		t.Error("long-lived connection still served after the old ztunnel exited")
	}
	if took < deadline-200*time.Millisecond || took > deadline+5*time.Second {
		t.Errorf("old ztunnel exited %v after the drain began; want about its %v deadline", took, deadline)
	}
	if got := oldNode.inpod.Stats().Active; got != 0 {
		t.Errorf("old ztunnel still runs %d pod proxies", got)
	}
	waitCount("requests through the new ztunnel alone", ok.Load()+20)
	close(stopLoad)
	load.Wait()
	stopLoad = make(chan struct{}) // for the deferred close
	if n := failed.Load(); n > 0 {
		t.Errorf("%d of %d new connections failed during the upgrade:\n%s", n, n+ok.Load(), strings.Join(failures, "\n"))
	}
	t.Logf("%d new connections, %d after the old ztunnel began draining; old exited %v into its drain",
		ok.Load(), ok.Load()-atDrain, took.Round(time.Millisecond))
	if ok.Load()-atDrain < 20 {
		t.Errorf("only %d new connections after the drain began; the load did not run through it", ok.Load()-atDrain)
	}
}
