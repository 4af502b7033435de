package hbone

import (
	"context"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// The tests here check that work for connections not yet served (accepting, refusing,
// handshaking) does not run ahead of goroutines already waiting for the CPU: in the node
// those are the readers of established connections, which the netpoller queues on a P,
// and Go's scheduler runs a goroutine that another wakes next, in the waker's time slice,
// ahead of that queue (docs/PERFORMANCE.md, "A stalled-handshake flood"). With one P the
// order the goroutines run in is the scheduler's, not the machine's; the race detector
// randomizes it, so they run without it (make test-norace: their names end in Yields).

// oneP runs the rest of the test on one P.
func oneP(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector randomizes which goroutine runs next (make test-norace runs this)")
	}
	prev := runtime.GOMAXPROCS(1)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
}

// A backlog of connections from a source past its budgets, and a goroutine queued to run
// before the accept loop starts on it: the goroutine runs after the first refusal, not
// after the whole backlog. (Before, the accept loop and each connection's serving
// goroutine woke each other in turn, 32 refusals before the queued goroutine ran.)
func TestAcceptYields(t *testing.T) {
	leaktest.Check(t)
	oneP(t)
	testCA()
	var drops dropCounts
	srv := NewServer(ServerConfig{Config: Config{OnDrop: drops.hook}, Admission: AdmissionConfig{SourceHandshakes: 1, SourceHandshakeRate: -1, SourceFailedHandshakes: -1}}, echo)
	release, _, _, ok := srv.adm.admitSource(floodSrc, false) // the source's one place, taken
	if !ok {
		t.Fatal("the source's first place refused")
	}
	defer release(false)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	al := srv.Admit(ln)
	const backlog = 32
	for range backlog {
		c, err := dialFrom(floodSrc, ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { al.Close(); srv.Close(); cancel(); wg.Wait() }()
	ran := make(chan int64, 1)
	wg.Go(func() { ran <- drops[DropSourceHandshakes].Load() }) // queued behind the loop below
	// The proxy's accept loop: a goroutine per connection.
	wg.Go(func() {
		for {
			c, err := al.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { srv.ServeTLS(ctx, c, srvTLS) })
		}
	})
	if refused := <-ran; refused > 2 {
		t.Errorf("a goroutine queued before the accept loop ran after %d of %d refusals; want it to run after the first", refused, backlog)
	}
}

// Handshakes queued at the gate, and a goroutine queued to run before the gate opens: it
// runs before the second handshake, not after the queue. (Before, each handshake let the
// next one in through the gate in its own time slice.)
func TestHandshakeGateYields(t *testing.T) {
	oneP(t)
	f := newAdmission(&ServerConfig{Admission: AdmissionConfig{HandshakeWorkers: 1}})
	ctx := context.Background()
	f.enterHandshake(ctx) // held until the queue has formed
	const queued = 32
	var done atomic.Int64
	var waiting, wg sync.WaitGroup
	waiting.Add(queued)
	for range queued {
		wg.Go(func() {
			waiting.Done()
			f.enterHandshake(ctx) // a handshake's computing part, between two reads
			done.Add(1)
			f.leaveHandshake()
		})
	}
	waiting.Wait() // each runs until it waits at the gate: one P, nothing preempts them
	ran := make(chan int64, 1)
	wg.Go(func() { ran <- done.Load() }) // queued before the gate opens
	f.leaveHandshake()
	if n := <-ran; n > 1 {
		t.Errorf("a goroutine queued before the gate opened ran after %d of %d handshakes; want it to run before the second", n, queued)
	}
	wg.Wait()
}
