package ca

import (
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	delegatedv1 "github.com/spiffe/spire-api-sdk/proto/spire/api/agent/delegatedidentity/v1"
	spiretypes "github.com/spiffe/spire-api-sdk/proto/spire/api/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/gozt/gozt/identity"
)

// Delegated is a client of a SPIRE agent's Delegated Identity API
// (spire.api.agent.delegatedidentity.v1, on the agent's admin socket): ztunnel, listed in
// the agent's authorized_delegates, subscribes to the X.509-SVIDs of each workload it
// serves, named by the selectors SPIRE's workload attestor would give it or by the PID of
// one of its processes, and the agent pushes each workload's SVIDs as it issues and
// rotates them. One stream per workload, one for the trust bundles (federated included).
//
// It is keyed per workload, not per identity: two pods of one service account have an SVID
// each (spire-controller-manager registers an entry per pod), and deleting one pod's entry
// ends that pod's SVID only. So it does not fit Client's "a leaf for this identity", which
// it implements only to be a provider (Fetch fails); identity/certs follows its pushes per
// workload (certs.Manager.Workload). SPIRE rotates the SVIDs, so nothing here renews.
type Delegated struct {
	conn   *grpc.ClientConn
	api    delegatedv1.DelegatedIdentityClient
	log    *slog.Logger
	ctx    context.Context // ends at Close: every stream's
	cancel context.CancelFunc
	wg     sync.WaitGroup // the bundle stream and every subscription
	closed sync.Once

	mu      sync.Mutex
	bundles map[string][]*x509.Certificate // guarded by mu: by trust domain name; nil until the first push
	subs    map[*subscription]struct{}     // guarded by mu: running subscriptions
}

// Selector is one selector of a workload in SPIRE's terms: Type "k8s", Value "ns:default".
type Selector struct{ Type, Value string }

func (s Selector) String() string { return s.Type + ":" + s.Value }

// K8sSelectors are the selectors SPIRE's k8s workload attestor gives a pod, of those the
// node knows (empty values are left out): k8s:ns, k8s:sa, k8s:pod-name, k8s:pod-uid and
// k8s:node-name. An entry matches a workload when all of its selectors are among these, so
// entries registered with any of them (spire-controller-manager's k8s:ns and k8s:pod-uid,
// or k8s:ns and k8s:sa) match.
func K8sSelectors(ns, sa, podName, podUID, node string) []Selector {
	var out []Selector
	for _, kv := range [][2]string{{"ns", ns}, {"sa", sa}, {"pod-name", podName}, {"pod-uid", podUID}, {"node-name", node}} {
		if kv[1] != "" {
			out = append(out, Selector{"k8s", kv[0] + ":" + kv[1]})
		}
	}
	return out
}

// DelegatedWorkload names a workload to the agent: by Selectors, or by PID (the agent
// attests that process itself; the caller must keep the PID from being reused while
// subscribed). Exactly one is set.
type DelegatedWorkload struct {
	Selectors []Selector
	PID       int32
}

// String is how the workload was named, for logs and /config_dump.
func (w DelegatedWorkload) String() string {
	if w.PID != 0 {
		return fmt.Sprintf("pid %d", w.PID)
	}
	s := make([]string, len(w.Selectors))
	for i, sel := range w.Selectors {
		s[i] = sel.String()
	}
	return "selectors " + strings.Join(s, ",")
}

// SVIDs is one push of a subscription. With Err nil, Issued is every SVID the agent gives
// the workload now (each with the trust bundle of its trust domain, then the bundles of the
// trust domains the workload federates with), possibly none: its entry was deleted, or none
// is registered yet. With Err set, the stream is down (the agent is away or refuses us) and
// Issued is nil: what the workload had is still what the agent last gave it.
type SVIDs struct {
	Issued []*Issued
	Err    error
}

// ErrNotDelegate wraps the agent's refusal of ztunnel as a delegate.
var ErrNotDelegate = errors.New("the SPIRE agent does not accept ztunnel as an authorized delegate (authorized_delegates in its configuration, and an entry for ztunnel's own workload)")

// Retry bounds of a broken stream: start, factor 2, ±20% jitter, cap.
const (
	delegatedRetryStart = 200 * time.Millisecond
	delegatedRetryMax   = 5 * time.Second
)

// NewDelegated returns a client of the agent's admin socket (a path, or a unix: address).
// It does not wait for the agent: the bundle stream starts now and reconnects until Close
// (the context is New's, bounding a start-up that here has nothing to wait for).
func NewDelegated(_ context.Context, socket string) (*Delegated, error) {
	if socket == "" {
		return nil, errors.New("ca: CA_PROVIDER=spire needs SPIRE_ADMIN_ENDPOINT_SOCKET")
	}
	target := socket
	if !strings.HasPrefix(target, "unix:") {
		target = "unix:" + target // gRPC's unix:path, absolute or relative
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithConnectParams(caConnectParams))
	if err != nil {
		return nil, fmt.Errorf("ca: SPIRE_ADMIN_ENDPOINT_SOCKET %q: %w", socket, err)
	}
	d := &Delegated{
		conn: conn, api: delegatedv1.NewDelegatedIdentityClient(conn),
		log:  slog.Default().With("component", "spire", "socket", socket),
		subs: map[*subscription]struct{}{},
	}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	d.wg.Add(1)
	go d.followBundles()
	return d, nil
}

// Fetch implements Client: SPIRE's SVIDs are a workload's, never asked for by identity
// alone (identity/certs subscribes per workload).
func (d *Delegated) Fetch(_ context.Context, id identity.ID) (*Issued, error) {
	return nil, fmt.Errorf("ca: CA_PROVIDER=spire issues SVIDs per workload: no workload of this node with identity %s is subscribed", id)
}

// Close ends every stream and waits for their goroutines; it is idempotent.
func (d *Delegated) Close() error {
	var err error
	d.closed.Do(func() {
		d.cancel()
		d.wg.Wait()
		err = d.conn.Close()
	})
	return err
}

// Bundles returns the trust bundles last pushed, by trust domain; nil before the first.
func (d *Delegated) Bundles() map[string][]*x509.Certificate {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.bundles
}

// followBundles runs the bundle stream until Close. A new set of bundles is pushed again to
// every subscription, re-assembled with the new roots.
func (d *Delegated) followBundles() {
	defer d.wg.Done()
	retrying(d.ctx, d.log, "bundles", func(ctx context.Context) error {
		stream, err := d.api.SubscribeToX509Bundles(ctx, &delegatedv1.SubscribeToX509BundlesRequest{})
		if err != nil {
			return err
		}
		for {
			resp, err := stream.Recv()
			if err != nil {
				return err
			}
			bundles := make(map[string][]*x509.Certificate, len(resp.CaCertificates))
			for td, der := range resp.CaCertificates {
				certs, err := x509.ParseCertificates(der)
				if err != nil {
					d.log.Warn("SPIRE agent sent a trust bundle that does not parse; left out", "trustDomain", td, "err", err)
					continue
				}
				bundles[strings.TrimPrefix(td, "spiffe://")] = certs
			}
			d.mu.Lock()
			d.bundles = bundles
			subs := make([]*subscription, 0, len(d.subs))
			for s := range d.subs {
				subs = append(subs, s)
			}
			d.mu.Unlock()
			for _, s := range subs {
				s.deliver()
			}
		}
	}, func(error) {})
}

// retrying runs stream until ctx ends, again after each failure with a backoff that
// restarts once a stream has run a while; failed hears each failure. A failure like the
// last one is logged at DEBUG, so an agent that stays away is one WARN.
func retrying(ctx context.Context, log *slog.Logger, what string, stream func(context.Context) error, failed func(error)) {
	backoff, last := time.Duration(0), ""
	for {
		start := time.Now()
		err := stream(ctx)
		if ctx.Err() != nil {
			return
		}
		err = delegatedError(err)
		failed(err)
		if time.Since(start) > delegatedRetryMax {
			backoff = 0 // it ran a while: this is a new failure, not the same one again
		}
		backoff = min(max(2*backoff, delegatedRetryStart), delegatedRetryMax)
		level := slog.LevelWarn
		if err.Error() == last {
			level = slog.LevelDebug
		}
		last = err.Error()
		log.Log(ctx, level, "SPIRE agent stream failed; retrying", "stream", what, "err", err, "retryIn", backoff)
		t := time.NewTimer(time.Duration(float64(backoff) * (0.8 + 0.4*rand.Float64())))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}

// delegatedError names the agent's refusal of us as a delegate.
func delegatedError(err error) error {
	if status.Code(err) == codes.PermissionDenied {
		return fmt.Errorf("ca: %w: %v", ErrNotDelegate, status.Convert(err).Message())
	}
	return fmt.Errorf("ca: SPIRE agent: %w", err)
}

// subscription is one workload's SVID stream.
type subscription struct {
	d    *Delegated
	w    DelegatedWorkload
	push func(SVIDs)

	mu      sync.Mutex                                // held while pushing, so pushes never overlap and none follows stop
	stopped bool                                      // guarded by mu
	latest  *delegatedv1.SubscribeToX509SVIDsResponse // guarded by mu: the last response; nil before the first
}

// Subscribe follows the SVIDs the agent gives w, calling push with each update, until stop
// is called; push runs on the subscription's goroutines one call at a time, must not block,
// and is not called once stop has returned. The first push comes once the agent has
// answered and the trust bundles are known.
func (d *Delegated) Subscribe(w DelegatedWorkload, push func(SVIDs)) (stop func()) {
	req := &delegatedv1.SubscribeToX509SVIDsRequest{Pid: w.PID}
	for _, s := range w.Selectors {
		req.Selectors = append(req.Selectors, &spiretypes.Selector{Type: s.Type, Value: s.Value})
	}
	s := &subscription{d: d, w: w, push: push}
	ctx, cancel := context.WithCancel(d.ctx)
	done := make(chan struct{})
	d.mu.Lock()
	d.subs[s] = struct{}{}
	d.mu.Unlock()
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		defer close(done)
		s.run(ctx, req)
	}()
	return func() {
		cancel()
		<-done
		d.mu.Lock()
		delete(d.subs, s)
		d.mu.Unlock()
		s.mu.Lock()
		s.stopped = true
		s.mu.Unlock()
	}
}

// run is the subscription's stream until ctx ends.
func (s *subscription) run(ctx context.Context, req *delegatedv1.SubscribeToX509SVIDsRequest) {
	retrying(ctx, s.d.log.With("workload", s.w.String()), "svids", func(ctx context.Context) error {
		stream, err := s.d.api.SubscribeToX509SVIDs(ctx, req)
		if err != nil {
			return err
		}
		for {
			resp, err := stream.Recv()
			if err != nil {
				return err
			}
			s.mu.Lock()
			s.latest = resp
			s.mu.Unlock()
			s.deliver()
		}
	}, func(err error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if !s.stopped {
			s.push(SVIDs{Err: err})
		}
	})
}

// deliver pushes the latest response assembled with the bundles held now; nothing until
// both have arrived.
func (s *subscription) deliver() {
	s.mu.Lock()
	defer s.mu.Unlock()
	bundles := s.d.Bundles()
	if s.stopped || s.latest == nil || bundles == nil {
		return
	}
	s.push(SVIDs{Issued: s.d.assemble(s.latest, bundles)})
}

// assemble turns a response into Issued values, each checked as every provider's are
// (identity, key, chain to its roots). An SVID that fails, or whose ID is not a mesh
// identity (spiffe://td/ns/NS/sa/SA), is left out with a log line.
func (d *Delegated) assemble(resp *delegatedv1.SubscribeToX509SVIDsResponse, bundles map[string][]*x509.Certificate) []*Issued {
	var out []*Issued
	for _, sv := range resp.X509Svids {
		iss, err := assembleSVID(sv, resp.FederatesWith, bundles)
		if err != nil {
			d.log.Warn("SPIRE agent sent an SVID that cannot be used; left out", "err", err)
			continue
		}
		out = append(out, iss)
	}
	return out
}

func assembleSVID(sv *delegatedv1.X509SVIDWithKey, federatesWith []string, bundles map[string][]*x509.Certificate) (*Issued, error) {
	svid := sv.GetX509Svid()
	if svid == nil || len(svid.CertChain) == 0 {
		return nil, errors.New("ca: SPIRE SVID with no certificate")
	}
	name := "spiffe://" + svid.GetId().GetTrustDomain() + svid.GetId().GetPath()
	id, err := identity.Parse(name)
	if err != nil {
		return nil, fmt.Errorf("ca: SPIRE SVID %s: %w", name, err)
	}
	chain := make([]*x509.Certificate, len(svid.CertChain))
	for i, der := range svid.CertChain {
		if chain[i], err = x509.ParseCertificate(der); err != nil {
			return nil, fmt.Errorf("ca: SPIRE SVID %s: %w", id, err)
		}
	}
	k, err := x509.ParsePKCS8PrivateKey(sv.X509SvidKey)
	if err != nil {
		return nil, fmt.Errorf("ca: SPIRE SVID %s: private key: %w", id, err)
	}
	key, ok := k.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("ca: SPIRE SVID %s: private key %T cannot sign", id, k)
	}
	roots := slices.Clone(bundles[id.TrustDomain()])
	if len(roots) == 0 {
		return nil, fmt.Errorf("ca: SPIRE SVID %s: the agent sent no bundle for trust domain %q", id, id.TrustDomain())
	}
	for _, td := range federatesWith {
		if td = strings.TrimPrefix(td, "spiffe://"); td != id.TrustDomain() {
			roots = append(roots, bundles[td]...)
		}
	}
	return assemble(id, key, chain, roots)
}
