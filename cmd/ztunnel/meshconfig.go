package main

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// meshConfigPath is where the Rust ztunnel reads the mesh config: relative to the working
// directory, which is / in the image, so /etc/istio/config/mesh when the istio ConfigMap is
// mounted there.
const meshConfigPath = "./etc/istio/config/mesh"

// meshProxyConfig is the part of Istio's ProxyConfig the Rust ztunnel reads, from the mesh
// config file's defaultConfig and from PROXY_CONFIG (YAML or JSON); other fields are
// ignored, as there. A nil field was not given.
type meshProxyConfig struct {
	DiscoveryAddress *string           `yaml:"discoveryAddress"`
	ProxyAdminPort   *uint16           `yaml:"proxyAdminPort"`
	StatsPort        *uint16           `yaml:"statsPort"`
	Concurrency      *uint16           `yaml:"concurrency"`
	ProxyMetadata    map[string]string `yaml:"proxyMetadata"`
}

// readProxyConfig reads the mesh config file at path (missing: nothing) and overlays
// PROXY_CONFIG (empty: nothing) on it field by field, proxyMetadata key by key, as the
// Rust ztunnel's construct_proxy_config does. An error names the source at fault.
func readProxyConfig(path, env string) (meshProxyConfig, error) {
	var pc meshProxyConfig
	b, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return pc, fmt.Errorf("config: mesh config file %s: %w", path, err)
	default:
		var mesh struct {
			DefaultConfig meshProxyConfig `yaml:"defaultConfig"`
		}
		if err := yaml.Unmarshal(b, &mesh); err != nil {
			return pc, fmt.Errorf("config: mesh config file %s: %v; accepted: YAML with defaultConfig, as Istio's mesh ConfigMap", path, err)
		}
		pc = mesh.DefaultConfig
	}
	if strings.TrimSpace(env) == "" {
		return pc, nil
	}
	var over meshProxyConfig
	if err := yaml.Unmarshal([]byte(env), &over); err != nil {
		return pc, fmt.Errorf("config: PROXY_CONFIG: %v; accepted: a ProxyConfig in YAML or JSON", err)
	}
	pc.DiscoveryAddress = orElse(over.DiscoveryAddress, pc.DiscoveryAddress)
	pc.ProxyAdminPort = orElse(over.ProxyAdminPort, pc.ProxyAdminPort)
	pc.StatsPort = orElse(over.StatsPort, pc.StatsPort)
	pc.Concurrency = orElse(over.Concurrency, pc.Concurrency)
	if len(over.ProxyMetadata) > 0 && pc.ProxyMetadata == nil {
		pc.ProxyMetadata = map[string]string{}
	}
	for k := range over.ProxyMetadata {
		// FOO and ISTIO_META_FOO name one key: PROXY_CONFIG's replaces the file's in
		// either spelling, so which wins does not depend on map order.
		name := strings.TrimPrefix(k, "ISTIO_META_")
		delete(pc.ProxyMetadata, name)
		delete(pc.ProxyMetadata, "ISTIO_META_"+name)
	}
	for k, v := range over.ProxyMetadata {
		pc.ProxyMetadata[k] = v
	}
	return pc, nil
}

// orElse is a if given, else b.
func orElse[T any](a, b *T) *T {
	if a != nil {
		return a
	}
	return b
}

// withPort is addr (a default, so well formed) with its port replaced.
func withPort(addr string, port uint16) string {
	host, _, _ := net.SplitHostPort(addr)
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}
