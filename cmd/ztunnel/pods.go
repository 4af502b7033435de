package main

import (
	"fmt"
	"log/slog"
	"net"

	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/inpod/podproxy"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// newPodProxies is in-pod mode's per-pod proxies (inpod/podproxy), built from the node's
// settings: each pod's proxy opens its sockets through the pod's, listens on the settings'
// ports on the pod's wildcard address and uses the node's resolver; each pod's DNS proxy,
// unless DNS_PROXY_ADDR=off, answers with the pod's namespace as its search list, not
// ztunnel's resolv.conf. Both watch their sockets with the node's poller (proxyConfig,
// dnsConfig).
func newPodProxies(n *ztunnel) *podproxy.Set {
	cfg := n.cfg
	pc := podproxy.Config{
		Node: n.local,
		Proxy: func(local state.Local, sockets netns.Sockets, log *slog.Logger) proxy.Config {
			pcfg := n.proxyConfig(local, log, sockets)
			pcfg.OutboundAddr = podAddr(cfg.OutboundAddr, cfg.IPv6Enabled)
			pcfg.InboundPlaintextAddr = podAddr(cfg.InboundPlaintextAddr, cfg.IPv6Enabled)
			pcfg.InboundAddr = podAddr(cfg.InboundAddr, cfg.IPv6Enabled)
			n.withResolver(&pcfg)
			return pcfg
		},
		Mark:          cfg.PacketMark,
		ReusePort:     cfg.InpodPortReuse,
		DrainDeadline: cfg.TerminationDeadline,
		Store:         n.store,
		Certs:         n.certs,
		Metrics:       n.metrics,
	}
	if cfg.DNSProxyAddr != "" {
		pc.DNS = n.dnsConfig
	}
	if n.spire {
		pc.PodCerts = n.podCerts
	}
	return podproxy.New(pc)
}

// podAddr is a pod listener's address: the setting's port on the wildcard address ([::],
// or 0.0.0.0 with IPV6_ENABLED=false); "" stays off.
func podAddr(setting string, ipv6 bool) string {
	if setting == "" {
		return ""
	}
	_, port, err := net.SplitHostPort(setting)
	if err != nil {
		return setting // loadConfig checked it; Listen reports it
	}
	if ipv6 {
		return net.JoinHostPort("::", port)
	}
	return net.JoinHostPort("0.0.0.0", port)
}

// inpodReady is the readiness check of in-pod mode: the workload manager has reconciled the
// node agent's snapshot and no pod's proxy is pending.
func (n *ztunnel) inpodReady() error {
	if n.inpod.Ready() {
		return nil
	}
	if st := n.inpod.Stats(); st.Pending > 0 {
		return fmt.Errorf("%d pod proxies failed to start (retried every 5s)", st.Pending)
	}
	return fmt.Errorf("no snapshot yet from the istio-cni node agent on %s", n.cfg.InpodUDS)
}

// podDump is one pod of /config_dump's workloadState, in the Rust ztunnel's shape:
// {state, info, connections: {inbound: [...], outbound: [...]}}.
type podDump struct {
	inpod.PodState
	Connections struct {
		Inbound  []proxy.ConnInfo `json:"inbound"`
		Outbound []proxy.ConnInfo `json:"outbound"`
	} `json:"connections"`
}

// workloadState is /config_dump's workloadState: each pod's state from the in-pod manager
// and the connections its proxy carries.
func (n *ztunnel) workloadState() map[string]podDump {
	out := map[string]podDump{}
	for uid, st := range n.inpod.WorkloadState() {
		d := podDump{PodState: st}
		d.Connections.Inbound, d.Connections.Outbound = []proxy.ConnInfo{}, []proxy.ConnInfo{}
		if in, outb, ok := n.pods.Connections(uid); ok {
			d.Connections.Inbound, d.Connections.Outbound = in, outb
		}
		out[uid] = d
	}
	return out
}
