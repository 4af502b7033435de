// Package inpodtest holds what tests of inpod.Manager (the workload manager) and of the code
// that wires it need: Proxies, a fake inpod.Proxies that records its calls and can bind a
// port in each pod's netns; and (Linux) Agent, the node agent's end of ZDS scripted one
// packet at a time, bad packets included, on inpod/zdsagent's wire helpers, with the
// requests it sends (AddReq, KeepReq, DelReq, SnapshotReq) and NSFD for a pod's netns fd.
package inpodtest

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"

	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/internal/netns"
)

var _ inpod.Proxies = (*Proxies)(nil)

// Proxies records every call. With Listen set, Start really binds that address inside the
// pod's netns (so a port already taken there fails it, like a real proxy); Drain and Stop
// close the listener and the pod's NetNS, which Start took over.
type Proxies struct {
	Listen string // e.g. "127.0.0.1:15008"; "" binds nothing

	mu      sync.Mutex
	calls   []string
	running map[string]running
}

type running struct {
	ns *netns.NetNS
	ln net.Listener
}

// Start records "start <uid>" and binds Listen in the pod's netns.
func (f *Proxies) Start(p inpod.Pod) error {
	var ln net.Listener
	if f.Listen != "" {
		var err error
		if ln, err = (netns.Sockets{NS: p.NetNS}).Listen(context.Background(), "tcp", f.Listen); err != nil {
			f.record("start-failed " + p.UID)
			return err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.running[p.UID]; ok {
		panic(fmt.Sprintf("inpodtest: Start(%s) while it runs", p.UID))
	}
	if f.running == nil {
		f.running = make(map[string]running)
	}
	f.running[p.UID] = running{p.NetNS, ln}
	f.calls = append(f.calls, "start "+p.UID)
	return nil
}

// Drain records "drain <uid>" and releases the pod.
func (f *Proxies) Drain(uid string) { f.end("drain", uid) }

// Stop records "stop <uid>" and releases the pod.
func (f *Proxies) Stop(uid string) { f.end("stop", uid) }

func (f *Proxies) end(what, uid string) {
	f.mu.Lock()
	r, ok := f.running[uid]
	delete(f.running, uid)
	f.calls = append(f.calls, what+" "+uid)
	f.mu.Unlock()
	if !ok {
		panic(fmt.Sprintf("inpodtest: %s(%s) of a pod that does not run", what, uid))
	}
	if r.ln != nil {
		r.ln.Close()
	}
	r.ns.Close()
}

func (f *Proxies) record(call string) {
	f.mu.Lock()
	f.calls = append(f.calls, call)
	f.mu.Unlock()
}

// Calls returns the calls since the last Calls, in order ("start a, drain b").
func (f *Proxies) Calls() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := strings.Join(f.calls, ", ")
	f.calls = nil
	return s
}

// Running returns how many pods run.
func (f *Proxies) Running() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.running)
}
