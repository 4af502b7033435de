package main

import (
	"github.com/gozt/gozt/internal/ktls"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// configDump is /config_dump's sections (admin.go serves them).
func (n *ztunnel) configDump() map[string]any {
	d := map[string]any{
		// fips140 (gozt's) is FIPS 140-3 mode, its module and build, where the Rust ztunnel
		// names its cryptoProvider.
		"version":      map[string]any{"version": version, "buildInfo": versionString(), "fips140": currentFIPS()},
		"config":       n.cfg,
		"certificates": n.certs.Dump(),
	}
	if n.crl != nil {
		crl := map[string]any{"path": n.cfg.CRLPath, "lists": n.crl.Info()}
		if err := n.crl.Refused(); err != nil {
			crl["refused"] = err.Error() // the file's content now; the lists above stay in force
		}
		d["crl"] = crl
	}
	if sd, ok := n.store.Dump().(*state.Dump); ok {
		d["workloads"], d["services"], d["policies"] = sd.Workloads, sd.Services, sd.Policies
	}
	if n.outliers != nil {
		d["ejectedEndpoints"] = n.outliers.Dump() // a gozt section: endpoints picked last, and until when
	}
	var conns [][]proxy.ConnInfo
	if n.proxy != nil {
		in, out := n.proxy.Connections()
		conns = append(conns, in, out)
	}
	if n.inpod != nil {
		ws := n.workloadState()
		d["workloadState"] = ws
		for _, pd := range ws {
			conns = append(conns, pd.Connections.Inbound, pd.Connections.Outbound)
		}
	}
	if n.proxy != nil || n.inpod != nil {
		d["kernelTls"] = kernelTLSDump(n.cfg.KernelTLS, n.cfg.KernelTLS && ktls.KernelRekeys(), conns)
	}
	return d
}

// kernelTLSDump is /config_dump's kernelTls (a gozt section): whether KERNEL_TLS is on,
// the proxied connections whose HBONE leg runs in kernel TLS and in user space, and
// keyUpdates: whether the kernel could take a peer's TLS 1.3 KeyUpdate (Linux 6.14+) and
// whether gozt follows it (not yet: a kernel TLS connection drains before the peer's
// KeyUpdate instead, hbone/keylimit.go; a peer that may send one, the Rust ztunnel, keeps
// its connections in user space, hbone.NextProtoNoKeyUpdate).
func kernelTLSDump(enabled, kernelRekeys bool, conns [][]proxy.ConnInfo) map[string]any {
	counts := map[string]int{"kernel": 0, "user": 0}
	for _, cs := range conns {
		for _, c := range cs {
			if c.TLS != "" {
				counts[c.TLS]++
			}
		}
	}
	return map[string]any{"enabled": enabled, "proxiedConnections": counts,
		"keyUpdates": map[string]bool{"kernelSupports": kernelRekeys, "followed": false}}
}
