package inpod

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/metrics"
)

// Defaults of Config's zero values.
const (
	DefaultPath          = "/var/run/ztunnel/ztunnel.sock"
	DefaultRetryInterval = 5 * time.Second
	DefaultMinBackoff    = 10 * time.Millisecond
	DefaultMaxBackoff    = 15 * time.Second
)

const msgConnectFailed = "cannot connect to the istio-cni node agent; is it running?"

// writeTimeout bounds sending one answer; istio-cni itself waits 5 s for it.
const writeTimeout = 5 * time.Second

// Config configures a Manager; the zero value is the documented default.
type Config struct {
	Path          string        // the agent's socket (INPOD_UDS); "" = DefaultPath
	RetryInterval time.Duration // between retries of pods whose Start failed; 0 = 5 s
	MinBackoff    time.Duration // first reconnect delay, doubling; 0 = 10 ms
	MaxBackoff    time.Duration // largest reconnect delay; 0 = 15 s
	Logger        *slog.Logger  // nil = slog.Default()
	// Metrics, if set, gets the workload_manager_* gauges and counters kept current.
	Metrics *metrics.Metrics
}

// Manager is the ZDS client and the per-pod state machine. Its one goroutine (run) owns the
// connection and the fields under "owned by run"; the others read what it publishes under mu.
type Manager struct {
	cfg     Config
	log     *slog.Logger
	proxies Proxies
	cancel  context.CancelFunc
	done    chan struct{} // closed when run has returned

	// Owned by run.
	running      map[string]runningPod // pods whose Start succeeded
	pending      map[string]Pod        // pods whose Start failed; each owns its NetNS
	snapshotDone bool                  // this connection's SnapshotSent has been handled
	named        map[string]bool       // pods the current snapshot named so far

	mu        sync.Mutex // guards the fields below; written by run, read by Ready and the views
	connected bool
	synced    bool // snapshotDone, published
	states    map[string]PodState
	stats     Stats
}

type runningPod struct {
	info WorkloadInfo
	ns   netns.ID
}

// New starts a Manager that connects to the agent and runs until Close.
func New(cfg Config, proxies Proxies) *Manager {
	if cfg.Path == "" {
		cfg.Path = DefaultPath
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{
		cfg:     cfg,
		log:     cfg.Logger,
		proxies: proxies,
		cancel:  cancel,
		done:    make(chan struct{}),
		running: make(map[string]runningPod),
		pending: make(map[string]Pod),
		states:  make(map[string]PodState),
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	m.log = m.log.With("component", "inpod")
	go m.run(ctx)
	return m
}

// Close disconnects from the agent, drains every pod's proxy gracefully and returns once the
// Manager's goroutine has exited. It is idempotent.
func (m *Manager) Close() error {
	m.cancel()
	<-m.done
	return nil
}

// Ready reports whether a snapshot has been reconciled on the current connection and no pod
// is pending: false while disconnected from the agent.
func (m *Manager) Ready() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.connected && m.synced && m.stats.Pending == 0
}

// WorkloadState returns a copy of every known pod's state, keyed by pod UID (the Rust
// ztunnel's workloadState in /config_dump).
func (m *Manager) WorkloadState() map[string]PodState {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.states)
}

// Stats returns the workload manager's counters.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stats
}

// run connects, serves and reconnects until the Manager closes, then drains every proxy.
func (m *Manager) run(ctx context.Context) {
	defer close(m.done)
	defer m.shutdown()
	wait := time.Duration(0)
	for {
		good := m.connectAndServe(ctx)
		if ctx.Err() != nil {
			return
		}
		// The delay starts again at MinBackoff after a connection that reconciled a snapshot
		// and then ended without an error of ours, and doubles otherwise, so that a peer that
		// keeps failing (or breaking the protocol) is not redialed every 10 ms.
		if good {
			wait = 0
		}
		wait = min(max(2*wait, m.cfg.MinBackoff), m.cfg.MaxBackoff)
		m.log.Debug("reconnecting to the node agent", "in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// connectAndServe runs one connection. It reports whether the connection reconciled a
// snapshot and ended by the peer going away rather than by a protocol or local error.
func (m *Manager) connectAndServe(ctx context.Context) bool {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unixpacket", m.cfg.Path)
	if err != nil {
		if ctx.Err() == nil {
			m.log.Warn(msgConnectFailed, "path", m.cfg.Path, "err", err)
		}
		return false
	}
	c := nc.(*net.UnixConn)
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() }) // unblocks a read on Close
	defer stop()

	m.newConnection()
	defer m.publish(false)
	if err := send(c, &zdspb.ZdsHello{Version: zdspb.Version_V1}); err != nil {
		m.log.Warn("node agent hello failed", "err", err)
		return false
	}
	m.publish(true)
	m.log.Info("connected to the istio-cni node agent", "path", m.cfg.Path)

	buf := new([maxMessage]byte)
	var retryAt time.Time
	for {
		if len(m.pending) == 0 {
			retryAt = time.Time{}
		} else if retryAt.IsZero() {
			retryAt = time.Now().Add(m.cfg.RetryInterval)
		}
		c.SetReadDeadline(retryAt)
		req, ns, err := readRequest(c, buf)
		var bad *badMessage
		switch {
		case err == nil:
		case errors.Is(err, os.ErrDeadlineExceeded) && ctx.Err() == nil:
			m.retryPending()
			retryAt = time.Time{}
			continue
		case errors.As(err, &bad):
			m.log.Error("bad message from the node agent", "err", err)
			m.answer(c, "failure to read message : "+err.Error())
			return false
		default: // EOF, I/O error or Close
			if ctx.Err() == nil {
				m.log.Warn("node agent connection ended", "err", err)
			}
			return m.snapshotDone && ctx.Err() == nil
		}
		m.log.Debug("node agent request", "request", req)
		nack, fatal := m.handle(req, ns)
		m.publish(true)
		if fatal {
			m.log.Error("node agent protocol error", "err", nack)
			nack = "failure to process message : " + nack
		}
		if err := m.answer(c, nack); err != nil || fatal {
			return false
		}
	}
}

// answer sends one WorkloadResponse; nack "" is an ACK.
func (m *Manager) answer(c *net.UnixConn, nack string) error {
	err := send(c, &zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: nack}}})
	if err != nil {
		m.log.Warn("cannot answer the node agent", "err", err)
	}
	return err
}

func send(c *net.UnixConn, msg proto.Message) error {
	b, err := proto.Marshal(msg)
	if err != nil {
		return err
	}
	c.SetWriteDeadline(time.Now().Add(writeTimeout))
	_, err = c.Write(b) // one packet
	return err
}

// newConnection forgets the previous connection's snapshot and pending pods; running proxies
// keep running until the new snapshot is reconciled.
func (m *Manager) newConnection() {
	m.snapshotDone = false
	m.named = make(map[string]bool)
	for uid := range m.pending {
		m.dropPending(uid)
	}
}

// handle applies one request. It returns the NACK text ("" = ACK) and whether the request
// broke the protocol, which ends the connection. It owns ns, which is nil unless req is Add.
func (m *Manager) handle(req *zdspb.WorkloadRequest, ns *netns.NetNS) (nack string, fatal bool) {
	switch p := req.Payload.(type) {
	case *zdspb.WorkloadRequest_Add:
		wi := p.Add.GetWorkloadInfo()
		if wi == nil {
			ns.Close()
			return fmt.Sprintf("add %s: workload_info is required", p.Add.GetUid()), true
		}
		return m.add(Pod{
			UID:   p.Add.GetUid(),
			Info:  WorkloadInfo{Name: wi.GetName(), Namespace: wi.GetNamespace(), ServiceAccount: wi.GetServiceAccount()},
			NetNS: ns,
		}), false
	case *zdspb.WorkloadRequest_Keep:
		if m.snapshotDone {
			return fmt.Sprintf("keep %s after the snapshot", p.Keep.GetUid()), true
		}
		m.named[p.Keep.GetUid()] = true
		return "", false
	case *zdspb.WorkloadRequest_Del:
		m.del(p.Del.GetUid())
		return "", false
	case *zdspb.WorkloadRequest_SnapshotSent:
		if m.snapshotDone {
			return "second snapshot on one connection", true
		}
		m.reconcile()
		return "", false
	}
	ns.Close()
	return fmt.Sprintf("unknown request %T", req.Payload), true // readRequest lets none through
}

func (m *Manager) add(p Pod) (nack string) {
	if !m.snapshotDone {
		m.named[p.UID] = true
	}
	if r, ok := m.running[p.UID]; ok {
		if r.ns == p.NetNS.ID() {
			p.NetNS.Close() // the same pod sandbox again: nothing to do
			return ""
		}
		// A new sandbox (the old netns is gone): stop the old proxy, start a new one.
		m.log.Info("pod has a new network namespace; replacing its proxy", "uid", p.UID)
		m.stop(p.UID, m.proxies.Stop)
	}
	if old, ok := m.pending[p.UID]; ok {
		old.NetNS.Close()
		delete(m.pending, p.UID)
	}
	if err := m.start(p); err != nil {
		return "failure to start proxy : " + err.Error()
	}
	return ""
}

// start calls Proxies.Start; on failure the pod is kept pending, with its NetNS.
func (m *Manager) start(p Pod) error {
	id := p.NetNS.ID() // p.NetNS belongs to Proxies once Start succeeds
	if err := m.proxies.Start(p); err != nil {
		m.log.Warn("pod proxy failed to start; will retry", "uid", p.UID,
			"namespace", p.Info.Namespace, "name", p.Info.Name, "err", err)
		m.pending[p.UID] = p
		m.setState(p.UID, &PodState{State: StatePending, Info: p.Info})
		return err
	}
	m.log.Info("pod proxy started", "uid", p.UID, "namespace", p.Info.Namespace, "name", p.Info.Name)
	m.running[p.UID] = runningPod{info: p.Info, ns: id}
	m.setState(p.UID, &PodState{State: StateUp, Info: p.Info})
	m.mu.Lock()
	m.stats.Started++
	m.mu.Unlock()
	if m.cfg.Metrics != nil {
		m.cfg.Metrics.ProxiesStarted.Inc()
	}
	return nil
}

// stop removes a running pod and hands its shutdown to how (Proxies.Drain or Stop).
func (m *Manager) stop(uid string, how func(string)) {
	delete(m.running, uid)
	m.setState(uid, nil)
	how(uid)
	m.mu.Lock()
	m.stats.Stopped++
	m.mu.Unlock()
	if m.cfg.Metrics != nil {
		m.cfg.Metrics.ProxiesStopped.Inc()
	}
}

func (m *Manager) del(uid string) {
	m.dropPending(uid)
	if !m.snapshotDone {
		// Before the snapshot, Del only unnames the pod; reconcile drains a proxy it runs.
		delete(m.named, uid)
		return
	}
	if _, ok := m.running[uid]; ok {
		m.stop(uid, m.proxies.Stop)
	}
}

// reconcile ends the snapshot: drain the proxies of pods it did not name.
func (m *Manager) reconcile() {
	for _, uid := range slices.Sorted(maps.Keys(m.running)) {
		if !m.named[uid] {
			m.log.Info("pod not in the node agent's snapshot; draining its proxy", "uid", uid)
			m.stop(uid, m.proxies.Drain)
		}
	}
	m.named = nil
	m.snapshotDone = true
}

// retryPending retries every pending pod once.
func (m *Manager) retryPending() {
	for _, uid := range slices.Sorted(maps.Keys(m.pending)) {
		p := m.pending[uid]
		delete(m.pending, uid)
		m.start(p)
	}
	m.publish(true)
}

// shutdown runs when the Manager closes: drain every proxy, release pending pods.
func (m *Manager) shutdown() {
	for _, uid := range slices.Sorted(maps.Keys(m.running)) {
		m.stop(uid, m.proxies.Drain)
	}
	for uid := range m.pending {
		m.dropPending(uid)
	}
	m.publish(false)
}

// dropPending forgets uid if it is pending: its NetNS is closed and its state gone.
func (m *Manager) dropPending(uid string) {
	if p, ok := m.pending[uid]; ok {
		p.NetNS.Close()
		delete(m.pending, uid)
		m.setState(uid, nil)
	}
}

// setState records uid's state for WorkloadState; nil forgets the pod.
func (m *Manager) setState(uid string, st *PodState) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if st == nil {
		delete(m.states, uid)
	} else {
		m.states[uid] = *st
	}
}

// publish makes the connection state and proxy counts visible to Ready, Stats and metrics.
func (m *Manager) publish(connected bool) {
	m.mu.Lock()
	m.connected = connected
	m.synced = connected && m.snapshotDone
	m.stats.Active, m.stats.Pending = len(m.running), len(m.pending)
	active, pending := m.stats.Active, m.stats.Pending
	m.mu.Unlock()
	if m.cfg.Metrics != nil {
		m.cfg.Metrics.ActiveProxies.Set(float64(active))
		m.cfg.Metrics.PendingProxies.Set(float64(pending))
	}
}
