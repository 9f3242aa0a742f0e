package telemetry

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// logArgsFrom is where a slog.Logger method's key-value arguments start.
var logArgsFrom = map[string]int{
	"Debug": 1, "Info": 1, "Warn": 1, "Error": 1,
	"DebugContext": 2, "InfoContext": 2, "WarnContext": 2, "ErrorContext": 2,
	"With": 0,
}

// R17.3: bcd's packages name every log key through this package's
// constants (one set of keys on every process): no string literal as a
// key of a log call (or of a slog.String, slog.Int, ... attribute) in
// internal/node.
func TestNodeLogKeysR17_3(t *testing.T) {
	fset := token.NewFileSet()
	calls := 0
	err := filepath.WalkDir("../../node", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, recv, name := selectorCall(n)
			if call == nil {
				return true
			}
			if recv == "slog" {
				// slog.String("key", v) and its kin: the key first.
				if len(call.Args) > 0 && isLiteral(call.Args[0]) && name != "New" {
					t.Errorf("%s: slog.%s key %s is a literal, not a telemetry.Log constant", fset.Position(call.Pos()), name, literal(call.Args[0]))
				}
				return true
			}
			from, ok := logArgsFrom[name]
			if !ok || len(call.Args) <= from {
				return true
			}
			calls++
			for i := from; i < len(call.Args); i += 2 {
				if isAttr(call.Args[i]) {
					i-- // an Attr is one argument, not a key and a value
					continue
				}
				if isLiteral(call.Args[i]) {
					t.Errorf("%s: log key %s is a literal, not a telemetry.Log constant", fset.Position(call.Args[i].Pos()), literal(call.Args[i]))
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if calls < 20 {
		t.Fatalf("found %d log calls in internal/node: the walk looks in the wrong place", calls)
	}
}

func isLiteral(e ast.Expr) bool {
	l, ok := e.(*ast.BasicLit)
	return ok && l.Kind == token.STRING
}

func literal(e ast.Expr) string { return e.(*ast.BasicLit).Value }

// isAttr reports whether e is a slog.X(...) call (an Attr argument).
func isAttr(e ast.Expr) bool {
	_, recv, _ := selectorCall(e)
	return recv == "slog"
}

// selectorCall is n as a call x.name(...): the call, x's name when x is
// an identifier ("" otherwise) and name; a nil call when n is not one.
func selectorCall(n ast.Node) (call *ast.CallExpr, recv, name string) {
	call, ok := n.(*ast.CallExpr)
	if !ok {
		return nil, "", ""
	}
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return nil, "", ""
	}
	if x, ok := sel.X.(*ast.Ident); ok {
		recv = x.Name
	}
	return call, recv, sel.Sel.Name
}
