package proxy

import (
	"sync"

	"github.com/gozt/gozt/hbone"
)

// kernelTLSLogged holds the fallback reasons already logged: once per process, since in
// in-pod mode a node runs a proxy per pod and the kernel's answer is the same for all.
var kernelTLSLogged sync.Map // reason string -> struct{}

// onTLS is hbone's Config.OnTLS: a metric per connection, an INFO line per fallback
// reason.
func (p *Proxy) onTLS(info hbone.TLSInfo) {
	result := "kernel"
	if !info.Kernel {
		result = info.Reason
	}
	if p.metrics != nil {
		p.metrics.HBONEKernelTLS.WithLabelValues(result).Inc()
	}
	if info.Kernel || info.Reason == "disabled" {
		return
	}
	if _, seen := kernelTLSLogged.LoadOrStore(info.Reason, struct{}{}); seen {
		return
	}
	attrs := []any{"reason", info.Reason}
	if info.Err != nil {
		attrs = append(attrs, "err", info.Err)
	}
	p.log.Info("proxy: HBONE connections stay on user-space TLS where the kernel cannot take them (logged once per reason)", attrs...)
}

// onKernelTLSEnd is hbone's Config.OnKernelTLSEnd.
func (p *Proxy) onKernelTLSEnd(b hbone.KernelTLSBytes) {
	if p.metrics == nil {
		return
	}
	m := p.metrics.HBONEKernelTLSBytes
	m.WithLabelValues("sent", "spliced").Add(float64(b.SplicedOut))
	m.WithLabelValues("sent", "copied").Add(float64(b.CopiedOut))
	m.WithLabelValues("received", "spliced").Add(float64(b.SplicedIn))
	m.WithLabelValues("received", "copied").Add(float64(b.CopiedIn))
}
