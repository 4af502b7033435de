package deptest

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestSwitchesDocumented keeps docs/TESTING.md's table of switches whole: every environment
// variable the tests and their helpers read, and every flag a test defines, has a row, and
// every row names something a test, the Makefile or a test script still reads.
func TestSwitchesDocumented(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs/TESTING.md"))
	if err != nil {
		t.Fatal(err)
	}
	documented := tableSwitches(string(doc))
	if len(documented) < 10 {
		t.Fatalf("docs/TESTING.md: only %d switches in its table; is the table still there?", len(documented))
	}
	files, err := parseTestFiles(root)
	if err != nil {
		t.Fatal(err)
	}
	read, problems := switchesRead(files)
	for _, p := range problems {
		t.Error(p)
	}
	if len(read) < 10 {
		t.Fatalf("found only %d switches read; the scan is not looking at the tests", len(read))
	}
	for name, where := range read {
		if !documented[name] && !notOurs[name] {
			t.Errorf("%s reads %s, which docs/TESTING.md's table of switches does not list: add a row", where, name)
		}
	}
	var elsewhere strings.Builder // where make variables and the scripts' own are read
	for _, pattern := range []string{"Makefile", "scripts/*.sh"} {
		paths, _ := filepath.Glob(filepath.Join(root, pattern))
		for _, p := range paths {
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			elsewhere.Write(b)
		}
	}
	for name := range documented {
		if _, ok := read[name]; !ok && !regexp.MustCompile(`\b`+regexp.QuoteMeta(name)+`\b`).MatchString(elsewhere.String()) {
			t.Errorf("docs/TESTING.md lists %s, which no test, Makefile target or test script reads: remove the row", name)
		}
	}
}

// notOurs are variables tests read that belong to the system or to Go.
var notOurs = map[string]bool{"PATH": true, "GODEBUG": true}

// tableSwitches is the set of names in the first column of doc's tables (a cell may name
// several: "`RS_HUB`, `RS_TAG`").
func tableSwitches(doc string) map[string]bool {
	names := map[string]bool{}
	tick := regexp.MustCompile("`([^`]+)`")
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		first := strings.SplitN(line, "|", 3)[1]
		for _, m := range tick.FindAllStringSubmatch(first, -1) {
			names[m[1]] = true
		}
	}
	return names
}

// testDirs are the module's packages outside tests whose every file is test code: a test
// helper package (its name says test) or these.
var testDirs = []string{"internal/attack", "bench", "cmd/zbench"}

// parseTestFiles parses the module's test code under root (every _test.go file, and every
// file of a test helper package), by directory. Other modules below root (tools/...) are
// left out.
func parseTestFiles(root string) (map[string][]goFile, error) {
	fset := token.NewFileSet()
	files := map[string][]goFile{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || exists(filepath.Join(path, "go.mod"))) {
				return filepath.SkipDir
			}
			return nil
		}
		dir := filepath.ToSlash(filepath.Dir(rel))
		helper := slices.Contains(testDirs, dir) || strings.Contains(filepath.Base(dir), "test")
		if !strings.HasSuffix(path, ".go") || !strings.HasSuffix(path, "_test.go") && !helper {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		files[dir] = append(files[dir], goFile{filepath.Base(path), f})
		return nil
	})
	return files, err
}

// goFile is a parsed file and its name.
type goFile struct {
	name string
	*ast.File
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// switchesRead finds, in files (by directory), the environment variables read with
// os.Getenv or os.LookupEnv and the flags defined with the flag package, each with where
// it is read ("dir/file.go" for a variable, "-name" for a flag). A variable is named by a
// string literal, a string constant of the package, or a parameter of a function whose
// callers in the package pass one of those. A read it cannot name is a problem.
func switchesRead(files map[string][]goFile) (map[string]string, []string) {
	read := map[string]string{}
	var problems []string
	for dir, fs := range files {
		consts := stringConsts(fs)
		value := func(e ast.Expr) (string, bool) {
			switch e := e.(type) {
			case *ast.BasicLit:
				s, err := strconv.Unquote(e.Value)
				return s, err == nil
			case *ast.Ident:
				s, ok := consts[e.Name]
				return s, ok
			}
			return "", false
		}
		type wrapper struct {
			fn  string
			arg int
		}
		var wrappers []wrapper
		for _, f := range fs {
			where := dir + "/" + f.name
			for _, decl := range f.Decls {
				fn, _ := decl.(*ast.FuncDecl)
				ast.Inspect(decl, func(n ast.Node) bool {
					call, ok := n.(*ast.CallExpr)
					if !ok || len(call.Args) == 0 {
						return true
					}
					switch pkg, name := selector(call.Fun); {
					case pkg == "os" && (name == "Getenv" || name == "LookupEnv"):
						if v, ok := value(call.Args[0]); ok {
							read[v] = where
						} else if i := paramIndex(fn, call.Args[0]); i >= 0 {
							wrappers = append(wrappers, wrapper{fn.Name.Name, i})
						} else {
							problems = append(problems, where+": an environment variable read by a name this test cannot follow: use a string constant")
						}
					case pkg == "flag" && slices.Contains([]string{"Bool", "Duration", "Float64", "Int", "Int64", "String", "Uint", "Uint64"}, name):
						if v, ok := value(call.Args[0]); ok {
							read["-"+v] = where
						}
					}
					return true
				})
			}
		}
		for _, w := range wrappers {
			for _, f := range fs {
				ast.Inspect(f.File, func(n ast.Node) bool {
					if call, ok := n.(*ast.CallExpr); ok {
						if id, ok := call.Fun.(*ast.Ident); ok && id.Name == w.fn && w.arg < len(call.Args) {
							if v, ok := value(call.Args[w.arg]); ok {
								read[v] = dir + "/" + f.name
							}
						}
					}
					return true
				})
			}
		}
	}
	return read, problems
}

// stringConsts maps the package's constants that are string literals to their values.
func stringConsts(fs []goFile) map[string]string {
	consts := map[string]string{}
	for _, f := range fs {
		ast.Inspect(f.File, func(n ast.Node) bool {
			if d, ok := n.(*ast.GenDecl); ok && d.Tok == token.CONST {
				for _, s := range d.Specs {
					vs := s.(*ast.ValueSpec)
					for i, name := range vs.Names {
						if i < len(vs.Values) {
							if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
								consts[name.Name], _ = strconv.Unquote(lit.Value)
							}
						}
					}
				}
			}
			return true
		})
	}
	return consts
}

func selector(e ast.Expr) (pkg, name string) {
	if s, ok := e.(*ast.SelectorExpr); ok {
		if id, ok := s.X.(*ast.Ident); ok {
			return id.Name, s.Sel.Name
		}
	}
	return "", ""
}

// paramIndex is the position of e among fn's parameters if e is one, else -1.
func paramIndex(fn *ast.FuncDecl, e ast.Expr) int {
	id, ok := e.(*ast.Ident)
	if !ok || fn == nil {
		return -1
	}
	i := 0
	for _, field := range fn.Type.Params.List {
		for _, name := range field.Names {
			if name.Name == id.Name {
				return i
			}
			i++
		}
	}
	return -1
}
