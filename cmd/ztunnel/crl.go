package main

import (
	"crypto/tls"
	"errors"
	"log/slog"

	"github.com/gozt/gozt/identity/certs"
	"github.com/prometheus/client_golang/prometheus"
)

// closeRevoked is CRL_PATH's reload callback: it checks the signatures of the lists the
// node's roots issued (certs.Manager.CheckCRL), and closes every HBONE connection, of the
// node's proxy and of every pod's, whose peer the lists now in force revoke, with one log
// line each naming the peer and the revoked certificate, as the Rust ztunnel does.
func (n *ztunnel) closeRevoked() {
	n.certs.CheckCRL()
	for _, p := range n.proxies() {
		p.CloseMatching(n.revokedPeer)
	}
	if n.pods != nil {
		n.pods.CloseMatching(n.revokedPeer)
	}
}

// revokedPeer is closeRevoked's judgement of one HBONE connection: an error closes it. A
// connection whose peer a list names but cannot be judged (certs.ErrNotJudged) is kept
// and counted as untracked, as the Rust ztunnel counts one its CRL index cannot hold.
func (n *ztunnel) revokedPeer(inbound bool, cs tls.ConnectionState) error {
	err := n.certs.Revoked(cs)
	if err == nil {
		return nil
	}
	direction, reporter := "outbound", "source"
	if inbound {
		direction, reporter = "inbound", "destination"
	}
	if errors.Is(err, certs.ErrNotJudged) {
		slog.Warn("HBONE connection not checked against the CRL", "direction", direction, "err", err)
		n.metrics.CRLUntracked.WithLabelValues(reporter).Inc()
		return nil
	}
	attrs := []any{"direction", direction}
	if re := (*certs.RevokedError)(nil); errors.As(err, &re) {
		peer := ""
		if len(re.Peer) > 0 {
			peer = re.Peer[0].String()
		}
		attrs = append(attrs, "peer", peer, "serial", re.Cert.SerialNumber.String(), "certificate", re.Cert.Subject.String(), "issuer", re.Issuer.Subject.String())
	}
	slog.Warn("closing HBONE connection: the CRL now revokes its peer's certificate", append(attrs, "err", err)...)
	n.metrics.CRLRejections.WithLabelValues(reporter).Inc()
	return err
}

// crlCollector exports each CRL in force: its this/next update and how many certificates it
// revokes, labelled by issuer and number (gozt's families; the Rust ztunnel has none), so an
// alert can fire before a list goes stale.
type crlCollector struct{ crl *certs.CRL }

var (
	crlLabels     = []string{"issuer", "number"}
	crlThisUpdate = prometheus.NewDesc("crl_this_update_timestamp_seconds", "When each CRL in force (CRL_PATH) was issued (gozt)", crlLabels, nil)
	crlNextUpdate = prometheus.NewDesc("crl_next_update_timestamp_seconds", "When each CRL in force (CRL_PATH) says the next is due; past it the list stays in force (gozt)", crlLabels, nil)
	crlRevoked    = prometheus.NewDesc("crl_revoked_certificates", "Certificates each CRL in force (CRL_PATH) revokes (gozt)", crlLabels, nil)
)

func (c crlCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- crlThisUpdate
	ch <- crlNextUpdate
	ch <- crlRevoked
}

func (c crlCollector) Collect(ch chan<- prometheus.Metric) {
	seen := map[[2]string]bool{} // a list given twice is one series, not a failed scrape
	for _, l := range c.crl.Info() {
		if seen[[2]string{l.Issuer, l.Number}] {
			continue
		}
		seen[[2]string{l.Issuer, l.Number}] = true
		ch <- prometheus.MustNewConstMetric(crlThisUpdate, prometheus.GaugeValue, float64(l.ThisUpdate.Unix()), l.Issuer, l.Number)
		if !l.NextUpdate.IsZero() {
			ch <- prometheus.MustNewConstMetric(crlNextUpdate, prometheus.GaugeValue, float64(l.NextUpdate.Unix()), l.Issuer, l.Number)
		}
		ch <- prometheus.MustNewConstMetric(crlRevoked, prometheus.GaugeValue, float64(l.Revoked), l.Issuer, l.Number)
	}
}
