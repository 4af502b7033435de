package main

import (
	"crypto/fips140"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
)

// fipsState is FIPS 140-3 mode as the start-up line and /config_dump report it. The mode
// is Go's (crypto/fips140): on when the binary was built with GOFIPS140 (make image
// FIPS=1), whose default GODEBUG then holds fips140=on, or when GODEBUG sets it; fixed for
// the life of the process. In it crypto/tls negotiates only approved parameters for every
// TLS use (HBONE, the CA and xDS clients, OTLP), identity/certs checks peer certificate keys
// as crypto/tls would, and kernel TLS is off (internal/ktls).
type fipsState struct {
	Enabled  bool   `json:"enabled"`  // crypto/fips140.Enabled
	Enforced bool   `json:"enforced"` // GODEBUG fips140=only: Go's testing mode, not for production
	Module   string `json:"module"`   // crypto/fips140.Version: the frozen module's version, or "latest"
	Build    string `json:"build"`    // GOFIPS140 the binary was built with ("v1.0.0-c2097c7c"); "off" if none
}

func currentFIPS() fipsState {
	f := fipsState{Enabled: fips140.Enabled(), Enforced: fips140.Enforced(), Module: fips140.Version(), Build: "off"}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "GOFIPS140" && s.Value != "" {
				f.Build = s.Value
			}
		}
	}
	return f
}

// check refuses a FIPS build running outside FIPS 140-3 mode: only an explicit
// GODEBUG=fips140=off can do that to it, and an image that says FIPS must not run without.
func (f fipsState) check() error {
	if f.Build != "off" && !f.Enabled {
		return fmt.Errorf("this binary was built for FIPS 140-3 (GOFIPS140=%s) but FIPS 140-3 mode is off (GODEBUG=%q): refusing to start; take fips140=off out of GODEBUG, or run a binary built without GOFIPS140", f.Build, os.Getenv("GODEBUG"))
	}
	return nil
}

// logValue is the start-up line's fips140 group.
func (f fipsState) logValue() slog.Value {
	return slog.GroupValue(slog.Bool("enabled", f.Enabled), slog.String("module", f.Module), slog.String("build", f.Build))
}

// errFIPSKernelTLS refuses KERNEL_TLS=true in FIPS 140-3 mode.
var errFIPSKernelTLS = errors.New("config: KERNEL_TLS=true: kernel TLS seals HBONE records with the kernel's AES-GCM, outside Go's validated cryptographic module, and FIPS 140-3 mode is on; leave KERNEL_TLS unset or false")

// fipsKernelTLS turns kernel TLS off in FIPS 140-3 mode (fips): by default, or with an error
// if explicit says KERNEL_TLS was set (to true).
func fipsKernelTLS(c *config, explicit map[string]bool, fips bool) error {
	if !fips || !c.KernelTLS {
		return nil
	}
	if explicit["KERNEL_TLS"] {
		return errFIPSKernelTLS
	}
	c.KernelTLS = false
	return nil
}
