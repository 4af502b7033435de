package proxy

import (
	"sync"

	"github.com/gozt/gozt/hbone"
)

// kernelTLSLogged holds the fallback reasons already logged: once per process, since in
// in-pod mode a node runs a proxy per pod and the kernel's answer is the same for all.
var kernelTLSLogged sync.Map // reason string -> struct{}

// OnTLS is hbone's Config.OnTLS: a metric per connection, an INFO line per fallback
// reason.
func (e *HBONEEvents) OnTLS(info hbone.TLSInfo) {
	result := "kernel"
	if !info.Kernel {
		result = info.Reason
	}
	if e.metrics != nil {
		e.metrics.HBONEKernelTLS.WithLabelValues(result).Inc()
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
	e.log.Info("proxy: HBONE connections stay on user-space TLS where the kernel cannot take them (logged once per reason)", attrs...)
}

// OnKernelTLSEnd is hbone's Config.OnKernelTLSEnd.
func (e *HBONEEvents) OnKernelTLSEnd(b hbone.KernelTLSBytes) {
	if e.metrics == nil {
		return
	}
	m := e.metrics.HBONEKernelTLSBytes
	m.WithLabelValues("sent", "spliced").Add(float64(b.SplicedOut))
	m.WithLabelValues("sent", "copied").Add(float64(b.CopiedOut))
	m.WithLabelValues("received", "spliced").Add(float64(b.SplicedIn))
	m.WithLabelValues("received", "copied").Add(float64(b.CopiedIn))
}
