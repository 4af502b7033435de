// Package proxy is the data plane of a node: the listeners (outbound capture 15001, inbound
// plaintext 15006, inbound HBONE 15008, SOCKS5 15080) and, for each connection, the flow of
// resolve → authorize → dial → copy → record.
//
// It owns connection handling and drain. It does not own the wire protocol (hbone), the
// workload cache (xds/state, read only), authorization rules (proxy/rbac), metric families
// (metrics) or where certificates come from: those arrive through the CertSource interface,
// so the data plane never imports the CA clients or the xDS client.
package proxy
