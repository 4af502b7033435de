// Command mkimg builds the images of make cluster-up (pause, Istio's pilot and install-cni,
// CoreDNS, the test app) from files on this machine, without a container daemon, as
// cmd/mkimage builds gozt's: one layer, fixed timestamps and owners, a docker-archive tarball
// that `ctr images import` takes. Each argument is one entry of the layer:
//
//	SRC=DST        the file SRC (followed if a symlink) at DST, with SRC's mode
//	DST->TARGET    a symlink
//	DST/           a directory (mode 0755; parents of every entry are made the same way)
//
//	mkimg -tag localhost/istio/pilot:1.31-dev -out pilot.tar -entrypoint /usr/local/bin/pilot-discovery \
//	    .tools/pilot-discovery=/usr/local/bin/pilot-discovery
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

var epoch = time.Unix(0, 0).UTC()

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(s string) error { *l = append(*l, s); return nil }

func main() {
	out := flag.String("out", "", "docker-archive tarball to write")
	user := flag.String("user", "0:0", "the image's user")
	workdir := flag.String("workdir", "/", "the image's working directory")
	var tags, entrypoint, env list
	flag.Var(&tags, "tag", "image reference written into the archive (repeat for more)")
	flag.Var(&entrypoint, "entrypoint", "entrypoint argument (repeat for more)")
	flag.Var(&env, "env", "NAME=VALUE (repeat)")
	flag.Parse()
	if len(tags) == 0 || *out == "" || len(entrypoint) == 0 {
		fmt.Fprintln(os.Stderr, "mkimg: -tag, -out and -entrypoint are required")
		os.Exit(2)
	}
	if err := build(tags, *out, *user, *workdir, entrypoint, env, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "mkimg:", err)
		os.Exit(1)
	}
}

type entry struct {
	src, target string
	dir         bool
}

func build(tags []string, out, user, workdir string, entrypoint, env, specs []string) error {
	refs := map[name.Reference]v1.Image{}
	for _, tag := range tags {
		ref, err := name.NewTag(tag)
		if err != nil {
			return err
		}
		refs[ref] = nil
	}
	entries := map[string]entry{}
	for _, s := range specs {
		switch {
		case strings.Contains(s, "->"):
			dst, target, _ := strings.Cut(s, "->")
			entries[clean(dst)] = entry{target: target}
		case strings.Contains(s, "="):
			src, dst, _ := strings.Cut(s, "=")
			entries[clean(dst)] = entry{src: src}
		case strings.HasSuffix(s, "/"):
			entries[clean(s)] = entry{dir: true}
		default:
			return fmt.Errorf("bad entry %q: want SRC=DST, DST->TARGET or DST/", s)
		}
	}
	for p := range entries {
		for d := path.Dir(p); d != "." && d != "/" && d != ""; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				entries[d] = entry{dir: true}
			}
		}
	}
	names := make([]string, 0, len(entries))
	for p := range entries {
		names = append(names, p)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, p := range names {
		e := entries[p]
		h := &tar.Header{Name: p, ModTime: epoch, Format: tar.FormatPAX}
		var data []byte
		switch {
		case e.dir:
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, p+"/", 0o755
			if p == "tmp" {
				h.Mode = 0o1777
			}
		case e.target != "":
			h.Typeflag, h.Linkname, h.Mode = tar.TypeSymlink, e.target, 0o777
		default:
			st, err := os.Stat(e.src)
			if err != nil {
				return err
			}
			if data, err = os.ReadFile(e.src); err != nil {
				return err
			}
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, int64(st.Mode().Perm()), int64(len(data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf.Bytes())), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return err
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.Append(base, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "mkimg"}})
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS, cf.Created = runtime.GOARCH, "linux", v1.Time{Time: epoch}
	cf.Config = v1.Config{Entrypoint: entrypoint, User: user, WorkingDir: workdir, Env: env}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	for ref := range refs {
		refs[ref] = img
	}
	return tarball.MultiRefWriteToFile(out, refs)
}

func clean(p string) string { return strings.TrimPrefix(path.Clean("/"+p), "/") }
