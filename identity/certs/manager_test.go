package certs_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/logtest"
	"github.com/gozt/gozt/internal/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var (
	idA = identity.MustParse("spiffe://cluster.local/ns/a/sa/alice")
	idB = identity.MustParse("spiffe://cluster.local/ns/b/sa/bob")
	idC = identity.MustParse("spiffe://cluster.local/ns/c/sa/carol")
)

var errDown = errors.New("gated: CA down")

// gatedCA signs real leaves with a test root but can be switched off or held, and records
// when it was asked.
type gatedCA struct {
	root *catest.Root
	ttl  time.Duration

	mu          sync.Mutex
	calls       []time.Time
	ids         []identity.ID // identity of each call
	fail        error
	hold        chan struct{} // non-nil: Fetch waits for it to close
	backdate    time.Duration // how long before the call each certificate's validity starts
	inflight    int
	maxInflight int
}

func newGated(t *testing.T, ttl time.Duration) *gatedCA {
	return &gatedCA{root: catest.NewRoot(t, "root"), ttl: ttl}
}

func (g *gatedCA) Fetch(ctx context.Context, id identity.ID) (*ca.Issued, error) {
	g.mu.Lock()
	g.calls = append(g.calls, time.Now())
	g.ids = append(g.ids, id)
	fail, hold := g.fail, g.hold
	g.inflight++
	g.maxInflight = max(g.maxInflight, g.inflight)
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		g.inflight--
		g.mu.Unlock()
	}()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if fail != nil {
		return nil, fail
	}
	start := time.Now().Add(-g.backdate)
	return g.root.IssueErr(id, start, start.Add(g.ttl))
}

func (g *gatedCA) Close() error { return nil }

func (g *gatedCA) set(fail error, hold chan struct{}) {
	g.mu.Lock()
	g.fail, g.hold = fail, hold
	g.mu.Unlock()
}

func (g *gatedCA) callTimes() []time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]time.Time(nil), g.calls...)
}

func mustCert(t *testing.T, m *certs.Manager, id identity.ID) *ca.Issued {
	t.Helper()
	iss, err := m.Certificate(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return iss
}

func TestRefreshAtHalfLife(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		m := certs.New(certs.Config{}, g)
		defer m.Close()
		start := time.Now()
		first := mustCert(t, m, idA)

		time.Sleep(30*time.Minute - time.Millisecond)
		synctest.Wait()
		if n := len(g.callTimes()); n != 1 {
			t.Fatalf("%d fetches before half-life; want 1", n)
		}
		if got := mustCert(t, m, idA); got != first {
			t.Error("cached certificate not served before half-life")
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		calls := g.callTimes()
		if len(calls) != 2 || calls[1].Sub(start) != 30*time.Minute {
			t.Fatalf("fetches at %v; want a second one at exactly 30m", calls)
		}
		second := mustCert(t, m, idA)
		if second.Certificate.Leaf.SerialNumber.Cmp(first.Certificate.Leaf.SerialNumber) == 0 {
			t.Error("rotation did not replace the certificate")
		}
		time.Sleep(30 * time.Minute)
		synctest.Wait()
		if n := len(g.callTimes()); n != 3 {
			t.Errorf("%d fetches after a full hour; want 3 (every half-life)", n)
		}
	})
}

// TestBackoffWhileCADown: the refresh fails, retries back off 1s, 2s, 4s ... capped at 150s
// with ±20% jitter, the old certificate serves until it expires, then callers get the CA's
// error, and the next retry after the CA returns makes it Available again.
func TestBackoffWhileCADown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		m := certs.New(certs.Config{}, g)
		defer m.Close()
		start := time.Now()
		old := mustCert(t, m, idA)
		g.set(errDown, nil)

		time.Sleep(time.Hour - time.Second)
		synctest.Wait()
		if got := mustCert(t, m, idA); got != old {
			t.Error("unexpired certificate not served while the CA is down")
		}
		calls := g.callTimes()
		if calls[1].Sub(start) != 30*time.Minute {
			t.Errorf("first refresh at %v; want 30m", calls[1].Sub(start))
		}
		base := time.Second
		capped := 0
		for i := 2; i < len(calls); i++ {
			d := calls[i].Sub(calls[i-1])
			lo, hi := time.Duration(float64(base)*0.8), time.Duration(float64(base)*1.2)
			if d < lo || d > hi {
				t.Errorf("retry %d after %v; want %v±20%%", i-1, d, base)
			}
			if base == 150*time.Second {
				capped++
			}
			base = min(2*base, 150*time.Second)
		}
		if capped < 5 {
			t.Errorf("only %d retries at the 150s cap in 30m of outage (%d calls)", capped, len(calls))
		}

		time.Sleep(2 * time.Second) // past NotAfter
		_, err := m.Certificate(context.Background(), idA)
		if err == nil || !strings.Contains(err.Error(), errDown.Error()) {
			t.Fatalf("expired and CA down: err = %v; want the CA's error", err)
		}
		if d := m.Dump(); len(d) != 1 || !strings.HasPrefix(d[0].State, "Unavailable: ") || !strings.Contains(d[0].State, errDown.Error()) {
			t.Errorf("dump = %+v; want Unavailable with the CA error", d)
		}

		g.set(nil, nil)
		time.Sleep(181 * time.Second) // longer than the longest jittered backoff
		synctest.Wait()
		if got := mustCert(t, m, idA); got.Certificate.Leaf.SerialNumber.Cmp(old.Certificate.Leaf.SerialNumber) == 0 {
			t.Error("still the expired certificate after the CA came back")
		}
		if d := m.Dump(); d[0].State != "Available" {
			t.Errorf("state = %q after recovery; want Available", d[0].State)
		}
	})
}

// TestFailFastWhileBackingOff: with no certificate and a retry far away, callers get the last
// error at once instead of each asking the CA again.
func TestFailFastWhileBackingOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		g.set(errDown, nil)
		m := certs.New(certs.Config{FetchTimeout: 10 * time.Second}, g)
		defer m.Close()
		for range 6 { // the first waits for the fetch; the others fail fast
			if _, err := m.Certificate(context.Background(), idA); err == nil {
				t.Fatal("certificate while the CA is down")
			}
		}
		n := len(g.callTimes())
		start := time.Now()
		_, err := m.Certificate(context.Background(), idA)
		if err == nil || !strings.Contains(err.Error(), "next try in") || time.Since(start) != 0 {
			t.Errorf("err = %v after %v; want an immediate error naming the next try", err, time.Since(start))
		}
		if got := len(g.callTimes()); got != n {
			t.Errorf("caller triggered a CA call while backing off (%d -> %d)", n, got)
		}
	})
}

func TestConcurrentCallersShareFetch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		hold := make(chan struct{})
		g.set(nil, hold)
		m := certs.New(certs.Config{}, g)
		defer m.Close()
		got := make([]*ca.Issued, 10)
		var wg sync.WaitGroup
		for i := range got {
			wg.Go(func() { got[i], _ = m.Certificate(context.Background(), idA) })
		}
		m.Prefetch(idA)
		synctest.Wait()
		if d := m.Dump(); len(d) != 1 || d[0].State != "Initializing" {
			t.Errorf("dump while fetching = %+v; want one Initializing entry", d)
		}
		close(hold)
		wg.Wait()
		if n := len(g.callTimes()); n != 1 {
			t.Errorf("%d CA calls for 10 concurrent callers; want 1", n)
		}
		for i, c := range got {
			if c == nil || c != got[0] {
				t.Errorf("caller %d got %p; want the shared %p", i, c, got[0])
			}
		}
	})
}

func TestMaxInflight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		hold := make(chan struct{})
		g.set(nil, hold)
		m := certs.New(certs.Config{MaxInflight: 3}, g)
		defer m.Close()
		for i := range 10 {
			id, _ := identity.New("", "ns", string(rune('a'+i)))
			m.Prefetch(id)
		}
		synctest.Wait()
		if n := len(g.callTimes()); n != 3 {
			t.Errorf("%d CSRs in flight; want MaxInflight 3", n)
		}
		close(hold)
		synctest.Wait()
		if n := len(g.callTimes()); n != 10 || g.maxInflight != 3 {
			t.Errorf("%d fetches, at most %d at once; want 10 and 3", n, g.maxInflight)
		}
		d := m.Dump()
		if len(d) != 10 {
			t.Fatalf("dump has %d entries; want 10", len(d))
		}
		for _, s := range d {
			if s.State != "Available" || len(s.CertChain) != 1 || len(s.RootCerts) != 1 {
				t.Errorf("entry %+v; want Available with leaf and root", s)
			}
		}
	})
}

// TestCallersBeforePrefetch: with one CSR slot busy and prefetches queued, a caller's fetch
// goes next, and so does a queued prefetch that a caller starts waiting for.
func TestCallersBeforePrefetch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		hold := make(chan struct{})
		g.set(nil, hold)
		m := certs.New(certs.Config{MaxInflight: 1}, g)
		defer m.Close()
		var bg []identity.ID
		for i := range 5 {
			id, _ := identity.New("", "bg", string(rune('a'+i)))
			bg = append(bg, id)
			m.Prefetch(id)
			synctest.Wait() // queue in a known order
		}
		var wg sync.WaitGroup
		wg.Go(func() { m.Certificate(context.Background(), idA) })
		synctest.Wait()
		wg.Go(func() { m.Certificate(context.Background(), bg[4]) }) // promote a queued prefetch
		synctest.Wait()
		close(hold)
		wg.Wait()
		synctest.Wait()
		g.mu.Lock()
		defer g.mu.Unlock()
		want := []identity.ID{bg[0], idA, bg[4], bg[1], bg[2], bg[3]}
		if !slices.Equal(g.ids, want) {
			t.Errorf("CSR order %v; want %v", g.ids, want)
		}
	})
}

func TestFetchTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		g.set(nil, make(chan struct{})) // never answers
		m := certs.New(certs.Config{FetchTimeout: 2 * time.Second}, g)
		defer m.Close()
		start := time.Now()
		_, err := m.Certificate(context.Background(), idA)
		if err == nil || !strings.Contains(err.Error(), "no certificate after 2s") || time.Since(start) != 2*time.Second {
			t.Errorf("err = %v after %v; want timeout after 2s", err, time.Since(start))
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if _, err := m.Certificate(ctx, idA); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("caller's context: err = %v; want deadline exceeded", err)
		}
	})
}

func TestForget(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		m := certs.New(certs.Config{}, g)
		defer m.Close()
		mustCert(t, m, idA)
		mustCert(t, m, idB)
		m.Forget(idA)
		m.Forget(idC) // unknown: no-op
		time.Sleep(31 * time.Minute)
		synctest.Wait()
		if n := len(g.callTimes()); n != 3 {
			t.Errorf("%d fetches; want 3 (A once, B twice: A's rotation stopped)", n)
		}
		if d := m.Dump(); len(d) != 1 || d[0].Identity != idB.String() {
			t.Errorf("dump = %+v; want only %s", d, idB)
		}
		mustCert(t, m, idA)
		if n := len(g.callTimes()); n != 4 {
			t.Errorf("%d fetches; want a fresh fetch for the forgotten identity", n)
		}
	})
}

func TestClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		g.set(nil, make(chan struct{}))
		m := certs.New(certs.Config{MaxInflight: 1}, g)
		m.Prefetch(idA) // blocked in the CA until Close cancels it
		m.Prefetch(idB) // queued for a CSR slot
		m.Prefetch(idC)
		synctest.Wait()
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Certificate(context.Background(), idA); err == nil || !strings.Contains(err.Error(), "closed") {
			t.Errorf("after Close: err = %v", err)
		}
	})
}

// TestIstioCADownKeepsServing runs the manager against the real gRPC CA in real time with a
// 4s lifetime: the refresh at half-life fails, is retried, the old leaf keeps serving until
// it expires, then callers see the CA's error.
func TestIstioCADownKeepsServing(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	c, err := ca.New(context.Background(), ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}, SecretTTL: 4 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	m := certs.New(certs.Config{}, c)
	defer m.Close()
	old := mustCert(t, m, idA)
	srv.SetFail(catest.ErrUnavailable)

	waitRequests := func(n int) {
		t.Helper()
		testutil.EventuallyNil(t, func() error {
			if got := len(srv.Requests()); got < n {
				return fmt.Errorf("CA saw %d requests; want %d", got, n)
			}
			return nil
		})
	}
	waitRequests(2) // the refresh at half-life failed
	if !time.Now().Before(old.NotAfter.Add(-500 * time.Millisecond)) {
		t.Fatal("refresh came too late to check serving (machine overloaded?)")
	}
	if got := mustCert(t, m, idA); got != old {
		t.Error("old certificate not served while the CA is down")
	}
	waitRequests(3) // and was retried
	time.Sleep(time.Until(old.NotAfter) + 50*time.Millisecond)
	if _, err := m.Certificate(context.Background(), idA); err == nil || !strings.Contains(err.Error(), "CA down") {
		t.Errorf("after expiry: err = %v; want the CA's error", err)
	}
}

// TestCachedAllocs: the per-connection lookup of a cached certificate allocates nothing.
func TestCachedAllocs(t *testing.T) {
	m := certs.New(certs.Config{}, newGated(t, time.Hour))
	defer m.Close()
	mustCert(t, m, idA)
	ctx := context.Background()
	if n := testing.AllocsPerRun(1000, func() { m.Certificate(ctx, idA) }); n != 0 {
		t.Errorf("cached Certificate allocates %v times; want 0", n)
	}
}

func BenchmarkCertificateCached(b *testing.B) {
	m := certs.New(certs.Config{}, &gatedCA{root: catest.NewRoot(b, "root"), ttl: time.Hour})
	defer m.Close()
	ctx := context.Background()
	if _, err := m.Certificate(ctx, idA); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.Certificate(ctx, idA)
		}
	})
}

// A certificate issued with most of its life already gone (a backdated NotBefore, a host
// clock ahead of the CA's) must not be renewed at once in a loop; one already expired is a
// failed fetch, retried with backoff, not a certificate.
func TestCertificatePastHalfLifeOnArrival(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		g.backdate = 50 * time.Minute // 10 minutes left
		m := certs.New(certs.Config{}, g)
		defer m.Close()
		mustCert(t, m, idA)
		time.Sleep(150*time.Second - time.Millisecond) // a quarter of what was left
		synctest.Wait()
		if n := len(g.callTimes()); n != 1 {
			t.Fatalf("%d fetches in the first 150 s; want 1", n)
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		if n := len(g.callTimes()); n != 2 {
			t.Fatalf("%d fetches after 150 s; want the renewal", n)
		}

		g.backdate = 2 * time.Hour // expired on arrival
		_, err := m.Certificate(context.Background(), idB)
		if err == nil || !strings.Contains(err.Error(), "expired") {
			t.Fatalf("Certificate = %v, want an error saying the certificate had expired", err)
		}
		calls := len(g.callTimes())
		time.Sleep(800*time.Millisecond - time.Millisecond) // the first retry: 1 s, -20% jitter
		synctest.Wait()
		if n := len(g.callTimes()); n != calls {
			t.Errorf("%d more fetches within 800 ms of an expired certificate; want retries to back off", n-calls)
		}
	})
}

// TestWarnOncePerError: a CA failing the same way on every retry is one WARN, not one per
// retry; a different error, or a failure after a success, warns again.
func TestWarnOncePerError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGated(t, time.Hour)
		g.set(errDown, nil)
		logs := &logtest.Recorder{}
		m := certs.New(certs.Config{Logger: logs.Logger()}, g)
		defer m.Close()
		warns := func() int { return len(logs.Lines(slog.LevelWarn)) }
		m.Prefetch(idA)
		time.Sleep(8 * time.Second) // retries after 1, 2 and 4 s (±20%)
		synctest.Wait()
		if n := len(g.callTimes()); n < 3 {
			t.Fatalf("%d fetches in 8 s; want at least 3", n)
		}
		if n := warns(); n != 1 {
			t.Errorf("%d WARNs for %d failures with one error; want 1:\n%s", n, len(g.callTimes()), strings.Join(logs.Lines(slog.LevelWarn), "\n"))
		}

		g.set(errors.New("gated: another error"), nil)
		time.Sleep(20 * time.Second)
		synctest.Wait()
		if n := warns(); n != 2 {
			t.Errorf("%d WARNs after the error changed; want 2", n)
		}

		g.set(nil, nil)
		time.Sleep(40 * time.Second) // past the longest backoff so far
		mustCert(t, m, idA)
		g.set(errDown, nil)
		time.Sleep(31 * time.Minute) // the refresh at half-life fails
		synctest.Wait()
		if n := warns(); n != 3 {
			t.Errorf("%d WARNs after a failure following a success; want 3", n)
		}
	})
}

// TestCAOutageFailFastAndRecovery: while the CA is down and an identity has no
// certificate, every caller after the first fails within retryWait (1 s) instead of the
// 10 s FetchTimeout, whether the CA refuses or hangs; the retries are capped so a caller
// gets a certificate within 3 s of the CA's return, and the CA is not hammered meanwhile.
func TestCAOutageFailFastAndRecovery(t *testing.T) {
	for _, hang := range []bool{false, true} {
		t.Run(map[bool]string{false: "refusing", true: "hanging"}[hang], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				g := newGated(t, time.Hour)
				hold := make(chan struct{})
				if hang {
					g.set(nil, hold)
				} else {
					g.set(errDown, nil)
				}
				m := certs.New(certs.Config{FetchTimeout: 10 * time.Second}, g)
				defer m.Close()
				if _, err := m.Certificate(context.Background(), idA); err == nil {
					t.Fatal("certificate while the CA is down")
				}
				const outage = time.Minute
				worst := time.Duration(0)
				for end := time.Now().Add(outage); time.Now().Before(end); {
					start := time.Now()
					if _, err := m.Certificate(context.Background(), idA); err == nil {
						t.Fatal("certificate while the CA is down")
					}
					worst = max(worst, time.Since(start))
					time.Sleep(100 * time.Millisecond) // a new connection every 100 ms
				}
				if worst > time.Second {
					t.Errorf("a caller waited %v during the outage; want at most 1s", worst)
				}
				if n := len(g.callTimes()); !hang && n > int(outage/time.Second)+2 {
					t.Errorf("%d CA calls in a %v outage; want about one every 1.5s", n, outage)
				}
				back := time.Now()
				g.set(nil, nil)
				if hang {
					close(hold)
				}
				for {
					if _, err := m.Certificate(context.Background(), idA); err == nil {
						break
					}
					time.Sleep(100 * time.Millisecond)
				}
				if d := time.Since(back); d > 3*time.Second {
					t.Errorf("certificate %v after the CA came back; want within 3s", d)
				}
			})
		})
	}
}

// TestFetchFailureReasons: each failed CSR is reported with a bounded reason, the one an
// operator needs to tell an expired token from a CA that is down; Expiries names the
// certificate in use per identity, and an identity that has none yet is left out.
func TestFetchFailureReasons(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	var mu sync.Mutex
	var reasons []string
	m := certs.New(certs.Config{FetchTimeout: 5 * time.Second, OnFetchFailure: func(r string) {
		mu.Lock()
		reasons = append(reasons, r)
		mu.Unlock()
	}}, g)
	defer m.Close()
	for _, c := range []struct {
		fail error
		want string
	}{
		{fmt.Errorf("ca: create certificate: %w", status.Error(codes.Unauthenticated, "token expired")), certs.CSRFailUnauthenticated},
		{status.Error(codes.PermissionDenied, "no"), certs.CSRFailPermissionDenied},
		{fmt.Errorf("ca: create certificate: %w", status.Error(codes.Unavailable, "connection refused")), certs.CSRFailUnavailable},
		{fmt.Errorf("ca: create certificate: %w", context.DeadlineExceeded), certs.CSRFailTimeout},
		{errors.New("ca: response for x has 1 chain elements, want leaf and root"), certs.CSRFailInvalidResponse},
		{errDown, certs.CSRFailOther},
	} {
		g.set(c.fail, nil)
		id := identity.MustParse("spiffe://cluster.local/ns/a/sa/" + c.want)
		if _, err := m.Certificate(context.Background(), id); err == nil {
			t.Fatalf("%v: Certificate succeeded", c.fail)
		}
		testutil.Eventually(t, "the failure reported", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(reasons) > 0 && reasons[len(reasons)-1] == c.want
		})
		m.Forget(id)
	}
	g.set(nil, nil)
	iss := mustCert(t, m, idA)
	exp := m.Expiries()
	if len(exp) != 1 || exp[0].Identity != idA.String() || !exp[0].NotAfter.Equal(iss.NotAfter) {
		t.Fatalf("Expiries = %+v; want %v until %v alone", exp, idA, iss.NotAfter)
	}
}
