package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// fipsModule is the Go Cryptographic Module the FIPS image is built with (Makefile
// FIPS_MODULE): v1.0.0, the version with a CMVP certificate (#5247).
const fipsModule = "v1.0.0"

// buildZtunnelFIPS builds the node binary as make image FIPS=1 does: GOFIPS140 links the
// frozen module and makes fips140=on the binary's default GODEBUG. Without -race even
// under -race: a race-enabled FIPS build would cost another cold build of every package
// (minutes here) for code the race-enabled default binary and in-process tests already run.
func buildZtunnelFIPS(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("the go tool is not on PATH; cannot build the FIPS ztunnel binary")
	}
	bin := filepath.Join(t.TempDir(), "ztunnel-fips")
	cmd := exec.Command(goTool, "build", "-trimpath", "-tags", buildTags, "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFIPS140="+fipsModule)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("GOFIPS140=%s go build ./cmd/ztunnel: %v\n%s", fipsModule, err, out)
	}
	return bin
}

// In FIPS 140-3 mode kernel TLS is off by default and an explicit KERNEL_TLS=true is
// refused; outside it nothing changes.
func TestFIPSKernelTLS(t *testing.T) {
	for _, tc := range []struct {
		name      string
		fips      bool
		env       map[string]string
		want      bool
		wantError error
	}{
		{"default", false, nil, true, nil},
		{"FIPS, default", true, nil, false, nil},
		{"FIPS, false", true, map[string]string{"KERNEL_TLS": "false"}, false, nil},
		{"FIPS, true", true, map[string]string{"KERNEL_TLS": "true"}, false, errFIPSKernelTLS},
		{"true", false, map[string]string{"KERNEL_TLS": "true"}, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "default/a/a"}
			explicit := map[string]bool{}
			for k, v := range tc.env {
				env[k], explicit[k] = v, true
			}
			c, err := loadConfig(func(k string) (string, bool) { v, ok := env[k]; return v, ok }, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			err = fipsKernelTLS(c, explicit, tc.fips)
			if !errors.Is(err, tc.wantError) {
				t.Fatalf("err = %v; want %v", err, tc.wantError)
			}
			if err == nil && c.KernelTLS != tc.want {
				t.Errorf("KernelTLS = %v; want %v", c.KernelTLS, tc.want)
			}
		})
	}
}

// A FIPS build refuses to run with FIPS 140-3 mode turned off; any other combination runs.
func TestFIPSCheck(t *testing.T) {
	for _, tc := range []struct {
		f  fipsState
		ok bool
	}{
		{fipsState{Build: "off"}, true},
		{fipsState{Build: "off", Enabled: true}, true}, // GODEBUG=fips140=on on a default build
		{fipsState{Build: "v1.0.0-c2097c7c", Enabled: true}, true},
		{fipsState{Build: "v1.0.0-c2097c7c"}, false},
		{fipsState{Build: "latest"}, false},
	} {
		err := tc.f.check()
		if (err == nil) != tc.ok || (err != nil && !strings.Contains(err.Error(), "refusing to start")) {
			t.Errorf("%+v: check() = %v; want ok %v", tc.f, err, tc.ok)
		}
	}
}
