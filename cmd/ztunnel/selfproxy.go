package main

import (
	"log/slog"

	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// selfWorkload is ztunnel's own workload (POD_NAMESPACE, POD_NAME, SERVICE_ACCOUNT, which
// the chart sets from the downward API); false unless all three are set.
func (c *config) selfWorkload() (state.WorkloadRef, bool) {
	ref := state.WorkloadRef{Namespace: c.PodNamespace, Name: c.PodName, ServiceAccount: c.ServiceAccount}
	return ref, ref.Namespace != "" && ref.Name != "" && ref.ServiceAccount != ""
}

// newSelfProxy is in-pod mode's self-proxy, as the Rust ztunnel's
// create_ztunnel_self_proxy_listener: an HBONE listener on INBOUND_ADDR's port in ztunnel's
// own network namespace that serves ztunnel's own workload, with its certificate and under
// its authorization policies, so that a meshed client (Prometheus) reaches ztunnel's own
// ports, the stats port above all, over mTLS. It is an inbound like a pod's: the HBONE
// target must be the address the connection came to, ztunnel's capture ports are refused,
// and the upstream leaves from ztunnel's own address (never the client's). nil, false when
// the mode is not shared, ztunnel's workload is not named or INBOUND_ADDR is off. Under
// CA_PROVIDER=spire it presents ztunnel's own workload's SVIDs, subscribed to until undo runs.
func newSelfProxy(n *ztunnel, undo *cleanups) (*proxy.Proxy, bool) {
	ref, ok := n.cfg.selfWorkload()
	addr := podAddr(n.cfg.InboundAddr, n.cfg.IPv6Enabled)
	if !ok || n.local.Mode != state.ModeShared || addr == "" {
		return nil, false
	}
	slog.Info("ztunnel self-proxy", "identity", "spiffe://"+n.cfg.TrustDomain+"/ns/"+ref.Namespace+"/sa/"+ref.ServiceAccount, "workload", ref.Namespace+"/"+ref.Name)
	pcfg := n.proxyConfig(n.local.Pod(ref), slog.Default().With("proxy", "self"), nil)
	pcfg.OutboundAddr, pcfg.InboundPlaintextAddr, pcfg.Socks5Addr = "", "", ""
	pcfg.InboundAddr = addr
	pcfg.OrigSrc = false
	var src proxy.CertSource = n.certs
	if n.spire {
		w, release, err := n.certs.Workload(n.spireRef(selfKey, ref.Namespace, ref.Name, ref.ServiceAccount, ""))
		if err != nil {
			slog.Error("self-proxy: no SPIRE subscription", "err", err)
			return nil, false
		}
		undo.push(release)
		src = w
	}
	return proxy.New(pcfg, n.store, src, n.metrics), true
}
